"""The emulated hosts' links (pdserve/lab/netns.py): what a link spec means, and a kernel without netem refusing
delay/loss rather than running unshaped."""
from __future__ import annotations

import pytest

from pdserve.lab.netns import LabUnavailable, Link, Network, check_available, netem_available


@pytest.mark.parametrize("text, link", [
    ("", Link()),
    ("10gbit", Link(rate_bps=10 * 10**9)),
    ("100mbit", Link(rate_bps=10**8)),
    ("1.5mbit,delay=2ms,jitter=0.5ms,loss=0.1%", Link(rate_bps=1_500_000, delay_ms=2.0, jitter_ms=0.5, loss_pct=0.1)),
])
def test_link_specs(text, link):
    assert Link.parse(text) == link
    assert link.needs_netem == bool(link.delay_ms or link.jitter_ms or link.loss_pct)


@pytest.mark.parametrize("bad", ["fast", "10gbit,colour=red", "delay=x"])
def test_bad_link_specs_name_the_problem(bad):
    with pytest.raises(ValueError):
        Link.parse(bad)


def test_delay_without_netem_is_refused_not_ignored():
    try:
        check_available()
    except LabUnavailable as e:
        pytest.skip(str(e))
    if netem_available():
        pytest.skip("this kernel has netem: delay is emulated")
    with Network(tag="t0") as net:
        with pytest.raises(LabUnavailable, match="netem"):
            net.add_host("h", Link(delay_ms=5))
        h = net.add_host("g", Link(rate_bps=10**8))  # a rate cap needs only tbf
        assert h.link.rate_bps == 10**8


def _connects(src, dst, port: int) -> bool:
    """Whether a TCP connection from host `src` to a listener on host `dst` completes within 1.5 s."""
    import subprocess
    import sys
    import time
    listen = (f"import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
              f"s.bind(('{dst.ip}',{port}));s.listen();s.settimeout(4);s.accept()")
    srv = subprocess.Popen([*dst.exec_prefix(), sys.executable, "-c", listen], stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.3)
        dial = f"import socket;socket.create_connection(('{dst.ip}',{port}),timeout=1.5)"
        return subprocess.run([*src.exec_prefix(), sys.executable, "-c", dial], capture_output=True).returncode == 0
    finally:
        srv.kill()
        srv.wait()


def test_a_one_way_cut_drops_one_direction_only_and_heals():
    try:
        check_available()
    except LabUnavailable as e:
        pytest.skip(str(e))
    with Network(tag="t1") as net:
        a, b, c = net.add_host("a"), net.add_host("b"), net.add_host("c")
        assert _connects(a, b, 5301) and _connects(b, a, 5302)
        net.cut(b, a)  # b's packets to a vanish: a TCP handshake fails both ways, c is unaffected
        assert not _connects(b, a, 5303) and not _connects(a, b, 5304)
        assert _connects(c, a, 5305) and _connects(b, c, 5306)
        net.cut(b, a, cut=False)
        assert _connects(b, a, 5307) and _connects(a, b, 5308)
