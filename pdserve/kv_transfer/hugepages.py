"""Back a CPU KV pool with transparent huge pages before NIXL registers it.

Between two processes on one host UCX moves DRAM blocks with CMA (`process_vm_readv`, one syscall per
descriptor), and the kernel pins the owner's pages and copies page by page: with 4 KiB pages that caps a batched
READ at ~5-8 GB/s on this box; with 2 MiB pages the same READ runs ~2x faster (`bench/kv_transfer.py`). The
engine allocates its pool with `torch.zeros` (pages already faulted in as 4 KiB), so MADV_HUGEPAGE alone would
only help future faults: MADV_COLLAPSE (Linux >= 6.1) rewrites the range into huge pages now, keeping its
contents (~1.2 s per GB here, once at start-up). Best effort: any failure leaves the pool as it was.
"""
from __future__ import annotations

import ctypes
import os

import torch

from pdserve import env_knobs

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE = 2 << 20

_libc = None


def _madvise(addr: int, length: int, advice: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise(addr, length, advice) == 0


def enabled() -> bool:
    """PDSERVE_KV_HUGEPAGES=0 turns it off (e.g. a very large pool whose collapse would slow start-up)."""
    return env_knobs.enabled("PDSERVE_KV_HUGEPAGES")


def use_huge_pages(t: torch.Tensor) -> int:
    """Advise and collapse the 2 MiB-aligned interior of a CPU tensor into huge pages; return bytes collapsed."""
    if t.device.type != "cpu" or not t.is_contiguous() or not enabled() or not os.uname().sysname == "Linux":
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    a, b = -(-start // HUGE) * HUGE, end // HUGE * HUGE  # only whole huge pages: never touch a neighbour's memory
    if b <= a:
        return 0
    if not _madvise(a, b - a, MADV_HUGEPAGE):  # THP disabled ("never") or not supported
        return 0
    return b - a if _madvise(a, b - a, MADV_COLLAPSE) else 0  # older kernel: khugepaged collapses it lazily
