"""The emulated hosts' links (pdserve/lab/netns.py): what a link spec means, and a kernel without netem refusing
delay/loss rather than running unshaped."""
from __future__ import annotations

import pytest

from pdserve.lab.netns import LabUnavailable, Link, Network, check_available, netem_available, nft_available


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


def test_delay_nowhere_to_run_is_refused_not_ignored(monkeypatch):
    """A machine with neither netem nor the packet filter's queue cannot delay: such a link is refused with the
    reason, never run unshaped (a rate cap alone still works)."""
    from pdserve.lab import delay, netns
    try:
        check_available()
    except LabUnavailable as e:
        pytest.skip(str(e))
    monkeypatch.setattr(netns, "netem_available", lambda: False)
    monkeypatch.setattr(delay, "available", lambda: False)
    with Network(tag="t0") as net:
        with pytest.raises(LabUnavailable, match="netem.*NFQUEUE"):
            net.add_host("h", Link(delay_ms=5))
        if not nft_available():
            with pytest.raises(LabUnavailable, match="loss"):
                net.add_host("l", Link(loss_pct=5))
        h = net.add_host("g", Link(rate_bps=10**8))  # a rate cap needs only tbf
        assert h.link.rate_bps == 10**8


def _echo_rtts(dst, port: int, n: int = 60) -> list[tuple[int, float]]:
    """(index, round trip s) of `n` UDP datagrams sent every 5 ms from the client to an echo on host `dst`, in the
    order the echoes came back."""
    import socket
    import subprocess
    import sys
    import threading
    import time
    srv = subprocess.Popen([*dst.exec_prefix(), sys.executable, "-c", _ECHO.format(ip=dst.ip, port=port)],
                           stderr=subprocess.DEVNULL)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.settimeout(0.3)
        for _ in range(50):  # until the echo answers
            s.sendto(b"-1", (dst.ip, port))
            try:
                s.recv(64)
                break
            except TimeoutError:
                pass
        time.sleep(0.3)  # late answers to the probes
        s.setblocking(False)
        while True:
            try:
                s.recv(64)
            except BlockingIOError:
                break
        s.settimeout(1.0)
        sent, got = {}, []

        def receive():
            try:
                while len(got) < n:
                    i = int(s.recv(64))
                    if i >= 0:
                        got.append((i, time.monotonic() - sent[i]))
            except TimeoutError:
                pass
        rx = threading.Thread(target=receive)
        rx.start()
        for i in range(n):
            sent[i] = time.monotonic()
            s.sendto(str(i).encode(), (dst.ip, port))
            time.sleep(0.005)
        rx.join()
        return got
    finally:
        s.close()
        srv.kill()
        srv.wait()


def test_delay_and_jitter_hold_each_packet_both_ways_in_order():
    """A 10 ms link (netem, or without it the NFQUEUE reader of lab/delay.py): a datagram to the host and its echo
    back each cross the link, so the round trip gains 2 x 10 ms; with 5 ms of jitter the round trips spread over
    [10, 30] ms yet come back in the order sent (the reader never lets a packet overtake another); reshaped to no
    delay the round trip is back under a few ms and the reader is gone; none is lost throughout."""
    from statistics import median
    try:
        check_available()
    except LabUnavailable as e:
        pytest.skip(str(e))
    from pdserve.lab import delay
    if not netem_available() and not delay.available():
        pytest.skip("delay needs netem or iptables' NFQUEUE, neither is here")
    with Network(tag="t5") as net:
        h = net.add_host("h", Link(rate_bps=40 * 10**6))
        base = median(r for _, r in _echo_rtts(h, 5330))
        net.shape(h, Link(rate_bps=40 * 10**6, delay_ms=10))
        reader = h.delayed
        net.shape(h, Link(rate_bps=20 * 10**6, delay_ms=10))  # another rate, the same delay: the same reader
        net.shape(h, Link(rate_bps=40 * 10**6, delay_ms=10))
        assert h.delayed is reader
        flat = _echo_rtts(h, 5331)
        net.shape(h, Link(rate_bps=40 * 10**6, delay_ms=10, jitter_ms=5))
        spread = _echo_rtts(h, 5332)
        net.shape(h, Link(rate_bps=40 * 10**6))
        after = median(r for _, r in _echo_rtts(h, 5333))
    assert len(flat) == len(spread) == 60, (len(flat), len(spread))
    rf = sorted(r for _, r in flat)
    assert 0.0195 <= rf[0] and median(rf) <= 0.040 + base, (base, rf)  # the ceiling allows a loaded box
    rs = sorted(r for _, r in spread)
    assert 0.0095 <= rs[0] and rs[int(0.9 * 60)] - rs[int(0.1 * 60)] >= 0.004, rs  # spread by the jitter
    assert [i for i, _ in spread] == list(range(60))  # in order
    assert base < 0.005 and after < 0.005, (base, after)
    if reader is not None:
        assert reader.proc.poll() is not None  # reshaping stopped the reader


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


_ECHO = ("import socket;s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM);s.bind(('{ip}',{port}));s.settimeout(8)\n"
         "s.setsockopt(socket.SOL_SOCKET,33,8<<20)\n"  # SO_RCVBUFFORCE: no datagram lost to a full buffer
         "while True:\n d,a=s.recvfrom(64);s.sendto(d,a)")


def _udp_echo_share(dst, port: int, n: int = 2000) -> float:
    """The share of `n` UDP datagrams from the client (root namespace) that come back from an echo on host `dst`:
    each must cross the host's link in and out, so with independent loss p per direction it is (1 - p) ** 2."""
    import socket
    import subprocess
    import sys
    import time
    srv = subprocess.Popen([*dst.exec_prefix(), sys.executable, "-c", _ECHO.format(ip=dst.ip, port=port)],
                           stderr=subprocess.DEVNULL)
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (root): the replies wait, none dropped
        s.settimeout(0.2)
        for _ in range(100):  # wait for the echo to answer (a probe may itself be lost): then count
            s.sendto(b"\xff\xff\xff\xff", (dst.ip, port))
            try:
                if s.recv(64) == b"\xff\xff\xff\xff":
                    break
            except TimeoutError:
                pass
        s.settimeout(1.0)
        seen = set()
        for i in range(n):  # paced in bursts of 50 so no socket buffer overflows: only the link loses packets
            s.sendto(i.to_bytes(4, "big"), (dst.ip, port))
            if i % 50 == 49:
                time.sleep(0.002)
        try:
            while len(seen) < n:
                seen.add(int.from_bytes(s.recv(64), "big"))
                seen.discard(0xFFFFFFFF)
        except TimeoutError:
            pass
        return len(seen) / n
    finally:
        srv.kill()
        srv.wait()


def test_loss_drops_that_share_each_way_and_reshaping_clears_it():
    """5% loss without netem (the packet filter) must lose about 1 - 0.95**2 = 9.75% of echoed datagrams (binomial
    sd 0.66% at n=2000: the bounds are ~4 sd), and setting the link back to lossless must lose none."""
    try:
        check_available()
    except LabUnavailable as e:
        pytest.skip(str(e))
    if not netem_available() and not nft_available():
        pytest.skip("loss needs netem or nft, neither is here")
    with Network(tag="t2") as net:
        h = net.add_host("h", Link(rate_bps=40 * 10**6, loss_pct=5.0))
        share = _udp_echo_share(h, 5311)
        assert 0.875 <= share <= 0.93, share
        net.shape(h, Link(rate_bps=40 * 10**6))
        assert _udp_echo_share(h, 5312) == 1.0


def test_two_labs_at_once_take_separate_subnets_and_both_carry_traffic():
    """Two test runs (or a test run and `pdserve lab`) on one machine: each lab's bridge takes a subnet no address
    of the machine uses yet, so the second one neither fails to start nor steals the first one's routes."""
    import ipaddress
    try:
        check_available()
    except LabUnavailable as e:
        pytest.skip(str(e))
    with Network(tag="s0") as one, Network(tag="s0") as two:  # one tag: a process's labs still get their own names
        assert not ipaddress.ip_network(one.net).overlaps(two.net) and one.bridge != two.bridge
        a1, b1 = one.add_host("a"), one.add_host("b")
        a2, b2 = two.add_host("a"), two.add_host("b")
        assert _connects(a1, b1, 5311) and _connects(a2, b2, 5312)


def test_hold_delays_packets_for_the_spike_and_drops_none():
    """A 200 ms delay spike without netem (`Network.hold`): UDP echoes sent every 10 ms through the host's link.
    Those sent during the hold come back late, the first of them by ~200 ms, none is lost, and once released the
    link answers at once again."""
    import socket
    import subprocess
    import sys
    import threading
    import time
    try:
        check_available()
    except LabUnavailable as e:
        pytest.skip(str(e))
    with Network(tag="t4") as net:
        h = net.add_host("h", Link(rate_bps=40 * 10**6))
        srv = subprocess.Popen([*h.exec_prefix(), sys.executable, "-c", _ECHO.format(ip=h.ip, port=5320)],
                               stderr=subprocess.DEVNULL)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.settimeout(0.1)
            for _ in range(100):  # until the echo answers
                s.sendto(b"-1", (h.ip, 5320))
                try:
                    s.recv(64)
                    break
                except TimeoutError:
                    pass
            sent, rtts = [], {}

            def send():
                for i in range(80):
                    sent.append(time.monotonic())
                    s.sendto(str(i).encode(), (h.ip, 5320))
                    time.sleep(0.01)

            def receive():  # each echo timed as it arrives
                s.settimeout(1.0)
                try:
                    while len(rtts) < 80:
                        i = int(s.recv(64))
                        if i >= 0:
                            rtts[i] = time.monotonic() - sent[i]
                except TimeoutError:
                    pass

            tx, rx = threading.Thread(target=send), threading.Thread(target=receive)
            rx.start()
            tx.start()
            time.sleep(0.3)
            t0 = time.monotonic()
            held = net.hold([h], 0.2)
            tx.join()
            rx.join()
        finally:
            srv.kill()
            srv.wait()
            s.close()
    # sent 50-120 ms into the hold (its tc writes can land tens of ms after t0 on a loaded box): all held but at
    # most one, the packet each paused end lets through on its full bucket (Network.hold)
    during = [rtts[i] for i, t in enumerate(sent) if t0 + 0.05 <= t < t0 + 0.12 and i in rtts]
    after = [rtts[i] for i, t in enumerate(sent) if t > t0 + 0.45 and i in rtts]
    print(f"held {held}; worst {max(rtts.values()) * 1e3:.0f} ms; during {[round(r * 1e3) for r in during]}")
    assert len(rtts) == len(sent), f"{len(sent) - len(rtts)} echoes lost"  # held, not dropped
    assert 0.1 <= held.at_least_s <= held.at_most_s <= 0.4 and held.queued_packets >= 1, held
    assert 0.15 <= max(rtts.values()) <= 0.45, max(rtts.values())
    assert len(during) >= 4 and sum(r < 0.06 for r in during) <= 1, during
    assert after and max(after) < 0.05, after
