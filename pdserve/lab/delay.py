"""Link delay and jitter without netem: the packet filter queues a host's packets to this process, which lets each
one go `delay` (+- jitter) after it was queued.

Why: the development machines' kernel has no `sch_netem`, and without delay the link axis of the break-even study
and the lab's faults had no standing latency. The kernel's NFQUEUE hands a queued packet to a userspace reader and
holds it until that reader says accept; here the verdict is simply sent late. The packet is never copied out
(NFQNL_COPY_META), so the cost is one netlink message in and one out per packet; with segmentation offload a
64 KiB segment is one packet.

Semantics, as netem's on both ends of the host's veth pair (`Network.shape`): packets the host sends and packets it
receives are each held `delay` ms, so a round trip through one delayed host gains 2 x delay. Jitter draws each
packet's delay uniformly from [delay - jitter, delay + jitter] but never lets a packet overtake the one queued before
it (netem reorders; TCP reads reordering as loss, and a link with a rate cap does not reorder either). The queue
holds at most `MAXLEN` packets; past that the kernel drops, as netem does past its limit. If this process dies the
rule has no reader and the host's packets are dropped (no `bypass`): a dead delay is a dead link, never a silently
unshaped one.

Run inside the host's namespace: `python -m pdserve.lab.delay --queue N --delay-ms D [--jitter-ms J]`; it prints
`ready` once bound, before the rule that feeds it is added.
"""
from __future__ import annotations

import argparse
import functools
import heapq
import os
import random
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
MAXLEN = 10000


def _attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def _message(msg: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body


def verdict(queue: int, packet_id: int) -> bytes:
    return _message(NFQNL_MSG_VERDICT, queue, _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id)))


def packet_ids(data: bytes) -> list[int]:
    """The ids of the queued packets in one read of the socket (several netlink messages)."""
    ids, off = [], 0
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            a = off + 20  # nlmsghdr (16) + nfgenmsg (4)
            while a + 4 <= off + length:
                alen, akind = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if akind & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, a + 4)[0])
                a += (alen + 3) & ~3
        off += (length + 3) & ~3
    return ids


def bind(queue: int) -> socket.socket:
    """A netlink socket bound to NFQUEUE `queue`, packets delivered as metadata only."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    s.bind((0, 0))
    for opt in (33, socket.SO_RCVBUF):  # SO_RCVBUFFORCE (root) first: a burst must not overflow the socket
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, 16 << 20)
            break
        except OSError:
            continue
    config = (_attr(NFQA_CFG_CMD, struct.pack("=BBH", NFQNL_CFG_CMD_BIND, 0, 0)),
              _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)),
              _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", MAXLEN)))
    for seq, attrs in enumerate(config, 1):
        s.send(_message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK, seq))
        _check_ack(s.recv(65536), seq)
    return s


def _check_ack(data: bytes, seq: int) -> None:
    length, kind, _, got = struct.unpack_from("=IHHI", data)
    if kind == NLMSG_ERROR:
        err = struct.unpack_from("=i", data, 16)[0]
        if err:
            raise OSError(-err, f"NFQUEUE config message {seq} refused")


class Delay:
    """The release schedule: each queued packet's due time, in queue order, never earlier than its predecessor's."""

    def __init__(self, delay_s: float, jitter_s: float = 0.0, rng: random.Random | None = None):
        self.delay_s, self.jitter_s = delay_s, jitter_s
        self.rng = rng or random.Random()
        self.heap: list[tuple[float, int]] = []
        self.last_due = 0.0

    def add(self, packet_id: int, now: float) -> None:
        d = self.delay_s + (self.rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0)
        self.last_due = max(now + max(0.0, d), self.last_due)
        heapq.heappush(self.heap, (self.last_due, packet_id))

    def due(self, now: float) -> list[int]:
        out = []
        while self.heap and self.heap[0][0] <= now:
            out.append(heapq.heappop(self.heap)[1])
        return out

    def wait_s(self, now: float) -> float | None:
        return max(0.0, self.heap[0][0] - now) if self.heap else None


def serve(s: socket.socket, queue: int, sched: Delay) -> None:
    s.setblocking(False)
    while True:
        now = time.monotonic()
        for pid in sched.due(now):
            s.send(verdict(queue, pid))
        ready, _, _ = select.select([s], [], [], sched.wait_s(time.monotonic()))
        if not ready:
            continue
        t = time.monotonic()
        while True:
            try:
                data = s.recv(1 << 20)
            except BlockingIOError:
                break
            except OSError as e:  # ENOBUFS: the kernel dropped messages for us; the packets it did send still count
                print(f"nfqueue {queue}: {e}", file=sys.stderr, flush=True)
                continue
            for pid in packet_ids(data):
                sched.add(pid, t)


QUEUE = 0  # NFQUEUE numbers are per network namespace: every host can use the same one


@functools.cache
def available() -> bool:
    """Whether delay can be emulated here without netem: `iptables` (its NFQUEUE target; this kernel's nftables
    has no `queue` expression but runs xtables targets) and a bindable queue, tried in a scratch namespace."""
    from pdserve.lab.netns import scratch_namespace
    if shutil.which("iptables") is None:
        return False
    with scratch_namespace("pddq") as ns:
        if ns is None:
            return False
        inside = ["ip", "netns", "exec", ns]
        r = subprocess.run([*inside, "iptables", "-t", "mangle", "-A", "OUTPUT", "-o", "lo", "-j", "NFQUEUE",
                            "--queue-num", str(QUEUE)], capture_output=True)
        probe = subprocess.run([*inside, sys.executable, "-c", f"from pdserve.lab.delay import bind; bind({QUEUE})"],
                               capture_output=True, env={**os.environ, "PYTHONPATH": _root()})
        return r.returncode == 0 and probe.returncode == 0


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rules(op: str, dev: str) -> list[list[str]]:
    """The host's packets out of and into its veth go to the queue (mangle: before routing on the way in)."""
    return [["iptables", "-t", "mangle", op, chain, flag, dev, "-j", "NFQUEUE", "--queue-num", str(QUEUE)]
            for chain, flag in (("OUTPUT", "-o"), ("PREROUTING", "-i"))]


class DelayedLink:
    """The delay of one host's link: its reader process in the host's namespace, then the rules that feed it."""

    def __init__(self, exec_prefix: list[str], dev: str, delay_ms: float, jitter_ms: float = 0.0):
        self.prefix, self.dev = exec_prefix, dev
        # its complaints go to a file: a pipe nobody reads would fill and stop the reader, and the link with it
        self.errors = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([*exec_prefix, sys.executable, "-m", "pdserve.lab.delay", "--queue", str(QUEUE),
                                      "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms)],
                                     stdout=subprocess.PIPE, stderr=self.errors, text=True,
                                     env={**os.environ, "PYTHONPATH": _root()})
        if self.proc.stdout.readline().strip() != "ready":
            self.proc.kill()
            self.proc.wait()
            self.errors.seek(0)
            raise RuntimeError(f"the delay reader did not start: {self.errors.read()[-500:].strip()}")
        for cmd in _rules("-A", dev):
            r = subprocess.run([*exec_prefix, *cmd], capture_output=True, text=True)
            if r.returncode != 0:
                self.close()
                raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")

    def close(self) -> None:
        """Rules first (a queue without its reader drops), then the reader. Idempotent."""
        for cmd in _rules("-D", self.dev):
            subprocess.run([*self.prefix, *cmd], capture_output=True)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.errors.close()


def _realtime() -> None:
    """The emulated wire must not wait for the hosts' CPUs: with the reader at normal priority and four busy loops on
    the 2 cores, 2 MB over 1gbit,delay=2ms took 117-1144 ms instead of 107-152 ms. SCHED_FIFO runs it as soon as a
    packet arrives; it sleeps in select() between packets, and the kernel's real-time throttling bounds it anyway.
    Without the privilege, the highest nice it may have."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        try:
            os.nice(-20)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queue", type=int, required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    a = p.parse_args(argv)
    _realtime()
    s = bind(a.queue)
    print("ready", flush=True)
    serve(s, a.queue, Delay(a.delay_ms / 1e3, a.jitter_ms / 1e3))


if __name__ == "__main__":
    main()
