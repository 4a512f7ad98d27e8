"""Huge-page backing of a KV pool: contents kept, only whole huge pages inside the tensor touched, opt-out."""

import torch

from pdserve.kv_transfer.hugepages import HUGE, use_huge_pages


def test_collapse_keeps_contents_and_stays_inside_the_tensor():
    t = torch.randint(0, 255, (5 * HUGE + 12345,), dtype=torch.uint8)
    before = t.clone()
    n = use_huge_pages(t)
    assert n % HUGE == 0 and 0 <= n <= t.numel()  # 0 where THP is off or the kernel lacks MADV_COLLAPSE
    assert torch.equal(t, before)


def test_small_non_cpu_or_disabled_is_a_no_op(monkeypatch):
    assert use_huge_pages(torch.zeros(1024)) == 0  # no whole huge page inside
    assert use_huge_pages(torch.zeros(4 * HUGE // 4)[::2]) == 0  # not contiguous
    monkeypatch.setenv("PDSERVE_KV_HUGEPAGES", "0")
    assert use_huge_pages(torch.zeros(4 * HUGE // 4)) == 0
