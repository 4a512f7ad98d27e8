"""Emulated hosts on one machine: each a Linux network namespace joined to one bridge by a veth pair, each link
shaped with `tc`.

The root namespace is the "client" host: it owns the bridge and its first address, so a test or a person on the
machine reaches every host's services over the bridge. Two hosts talk only through their veth pairs and the bridge:
real TCP over real interfaces. (They still share the kernel, /dev/shm and process ids: what crosses between them is
what their programs send over the network, which is why the lab also tells UCX to use TCP only; cluster.py.)

Shaping (`Link`): a token bucket (`tbf`) caps the rate on both ends of a host's veth pair, so traffic to and from the
host is held to the link's rate. Delay and jitter use the `netem` queueing discipline where the kernel has it;
otherwise the packet filter queues the host's packets to a reader process that lets each go after its delay
(`delay.py`: NFQUEUE, the same semantics: both directions delayed). Loss uses netem where the kernel has it;
otherwise a random-drop rule of the packet filter (`nft`, `numgen random`) in the host's own namespace drops that
share of the packets the host sends and of those it receives, as netem on both ends of the pair would. A `Link`
this machine cannot emulate is refused with the reason, never run silently unshaped.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass, field


class LabUnavailable(RuntimeError):
    """This machine cannot run the lab (not root, no `ip`/`tc`, no network namespaces, no netem): the reason."""


@dataclass(frozen=True)
class Link:
    """A host's link to the bridge. rate: bit/s (0: not capped); delay/jitter: ms; loss: percent."""

    rate_bps: int = 0
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0

    @property
    def needs_netem(self) -> bool:
        """Delay/jitter always; loss only where netem exists (else the packet filter drops: `loss_by_filter`)."""
        return bool(self.delay_ms or self.jitter_ms or self.loss_pct)

    @classmethod
    def parse(cls, text: str) -> Link:
        """`10gbit`, `100mbit,delay=2ms,loss=0.1%` (empty: unshaped)."""
        kw: dict = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, val = part.partition("=")
            if not eq:
                kw["rate_bps"] = _rate(part)
            elif key in ("delay", "jitter"):
                kw[f"{key}_ms"] = float(val.removesuffix("ms"))
            elif key == "loss":
                kw["loss_pct"] = float(val.removesuffix("%"))
            else:
                raise ValueError(f"unknown link setting {key!r} (rate, delay=, jitter=, loss=)")
        return cls(**kw)


_UNITS = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}


def _rate(text: str) -> int:
    for unit, mult in _UNITS.items():
        if text.lower().endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    raise ValueError(f"{text!r} is not a rate (e.g. 10gbit, 100mbit)")


@dataclass
class Host:
    name: str
    ns: str      # network namespace
    ip: str
    veth: str    # the interface inside the namespace
    peer: str    # its other end, on the bridge
    link: Link = field(default_factory=Link)
    delayed: object | None = None  # delay.DelayedLink where delay runs without netem

    def exec_prefix(self) -> list[str]:
        """Run a command on this host."""
        return ["ip", "netns", "exec", self.ns]


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise LabUnavailable(f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()}")


def check_available() -> None:
    """Raise LabUnavailable naming what is missing."""
    if os.geteuid() != 0:
        raise LabUnavailable("the lab needs root (network namespaces, veth pairs, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LabUnavailable(f"`{tool}` (iproute2) is not installed")


def netem_available() -> bool:
    """Whether this kernel has the netem queueing discipline (delay, jitter, loss)."""
    name = f"pdnm{os.getpid() % 100000}"
    if subprocess.run(["ip", "link", "add", name, "type", "dummy"], capture_output=True).returncode != 0:
        return False
    try:
        return subprocess.run(["tc", "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms"],
                              capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True)


@contextlib.contextmanager
def scratch_namespace(prefix: str):
    """A network namespace to try something in, removed afterwards; None where one cannot be made."""
    ns = f"{prefix}{os.getpid() % 100000}"
    if subprocess.run(["ip", "netns", "add", ns], capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@functools.cache
def nft_available() -> bool:
    """Whether the packet filter can drop at random here (`nft` installed and the kernel's nf_tables + numgen)."""
    if shutil.which("nft") is None:
        return False
    with scratch_namespace("pdnf") as ns:
        return ns is not None and subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"],
                                                 input=_loss_rules(1.0), text=True, capture_output=True).returncode == 0


def _loss_rules(loss_pct: float, dev: str = "lo", table: str = "pdlab_loss") -> str:
    """An nft table dropping `loss_pct` percent of the packets arriving on `dev`, at its ingress: silently, as a
    lossy wire does (a drop on the sender's output hook would fail its sendto() with EPERM instead)."""
    rule = f"numgen random mod 10000 < {round(loss_pct * 100)} drop"
    return (f"table netdev {table} {{\n"
            f"  chain in {{ type filter hook ingress device \"{dev}\" priority 0; {rule}; }}\n"
            "}\n")


NOWHERE_MAC = "02:00:5e:00:53:01"  # locally administered; no interface of the lab has it


def _check_link(link: Link) -> None:
    """Refuse, with the reason, a link this machine cannot emulate (never run it unshaped)."""
    if not link.needs_netem or netem_available():
        return
    from pdserve.lab import delay
    if (link.delay_ms or link.jitter_ms) and not delay.available():
        raise LabUnavailable("delay and jitter need the netem qdisc (this kernel has no sch_netem) or iptables' "
                             "NFQUEUE target (scripts/install.sh installs iptables when root); rate caps (tbf) and "
                             "loss (nft) work without them")
    if not link.loss_pct:
        return
    if not nft_available():
        raise LabUnavailable("loss needs the netem qdisc or the packet filter (`nft` with nf_tables numgen); this "
                             "machine has neither (scripts/install.sh installs nftables when root)")


def _tbf_args(rate_bps: int) -> list[str]:
    """A link's token bucket; burst: at least 10 ms of the rate (and 64 KiB), so the bucket itself is not the
    limit."""
    return ["rate", f"{rate_bps}bit", "burst", str(max(64 << 10, rate_bps // 8 // 100)), "latency", "50ms"]


@dataclass(frozen=True)
class Held:
    """What `Network.hold` did: each link end held between `at_least_s` and `at_most_s`; `queued_packets` in
    their queues, read from ~100 ms before the release."""

    at_least_s: float
    at_most_s: float
    queued_packets: int


class _TcBatch:
    """A `tc -batch -` in one namespace (None: this one): commands written, then `wait` until they ran (a
    one-line `qdisc show dev lo` after them comes back: tc runs a batch in order and flushes each answer)."""

    def __init__(self, ns: str | None):
        self.proc = subprocess.Popen(["tc", *(["-n", ns] if ns else []), "-batch", "-"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)

    def send(self, lines: list[str]) -> None:
        self.proc.stdin.write("".join(f"{ln}\n" for ln in [*lines, "qdisc show dev lo"]))
        self.proc.stdin.flush()

    def wait(self) -> None:
        if not self.proc.stdout.readline():  # tc stops a batch at its first failing command
            self.proc.wait()
            raise LabUnavailable(f"tc qdisc change failed: {self.proc.stderr.read().strip()}")

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait()


def _queued(devs: dict[str | None, list[str]]):
    """Start reading the packets queued in the root qdiscs of these devices, by namespace (None: this one), one
    `tc` per namespace; returns the function that waits for the readings and sums them."""
    import json
    procs = [(subprocess.Popen(["tc", *(["-n", ns] if ns else []), "-j", "-s", "qdisc", "show"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True), set(names))
             for ns, names in devs.items()]

    def total() -> int:
        n = 0
        for p, names in procs:
            out, _ = p.communicate()
            n += sum(q.get("qlen", 0) for q in json.loads(out or "[]") if q.get("root") and q.get("dev") in names)
        return n
    return total


_LOCK = "/tmp/pdserve-lab.lock"
_NETWORKS = itertools.count()


def _free_subnet() -> str:
    """The first 10.213.N.0/24 that no IPv4 address of this machine's root namespace falls in."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    used = [ipaddress.ip_interface(w).network for line in out.splitlines() for w in line.split()[3:4]]
    for n in range(256):
        net = ipaddress.ip_network(f"10.213.{n}.0/24")
        if not any(net.overlaps(u) for u in used):
            return str(net)
    raise LabUnavailable("no free 10.213.N.0/24 subnet left for a lab bridge (stale labs? `ip -4 addr`)")


class Network:
    """One bridge, its hosts; `close` removes everything it made (idempotent; also after a partial start)."""

    def __init__(self, tag: str | None = None, subnet: str | None = None):
        """`subnet`: by default the first 10.213.N.0/24 no route of this machine uses yet, so that labs of two
        processes (two test runs, a test run and `pdserve lab`) run side by side; names carry the pid for the
        same reason."""
        check_available()
        n = next(_NETWORKS)  # a second lab in this process (the break-even's paired phase runs several at once)
        self.tag = f"{tag or ''}{os.getpid() % 10000}{'' if n == 0 else chr(ord('a') + n % 26)}"
        self.bridge = f"pdl{self.tag}"
        self.hosts: dict[str, Host] = {}
        self._made: list[tuple[str, str]] = []  # ("link" | "netns", name) to remove, newest last
        with open(_LOCK, "a") as lock:  # choosing a free subnet and taking it: one process at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.net = ipaddress.ip_network(subnet or _free_subnet())
            self._addrs = self.net.hosts()
            self.gateway_ip = str(next(self._addrs))  # the bridge: the root namespace's address
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _run("ip", "addr", "add", f"{self.gateway_ip}/{self.net.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def add_host(self, name: str, link: Link = Link()) -> Host:
        _check_link(link)
        i = len(self.hosts)
        h = Host(name, f"{self.bridge}-{name}", str(next(self._addrs)), f"eth-{self.tag}-{i}"[:15],
                 f"br-{self.tag}-{i}"[:15], link)
        _run("ip", "netns", "add", h.ns)
        self._made.append(("netns", h.ns))
        _run("ip", "link", "add", h.peer, "type", "veth", "peer", "name", h.veth)
        self._made.append(("link", h.peer))
        _run("ip", "link", "set", h.veth, "netns", h.ns)
        _run("ip", "link", "set", h.peer, "master", self.bridge)
        _run("ip", "link", "set", h.peer, "up")
        inside = h.exec_prefix()
        _run(*inside, "ip", "addr", "add", f"{h.ip}/{self.net.prefixlen}", "dev", h.veth)
        _run(*inside, "ip", "link", "set", h.veth, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        _run(*inside, "ip", "route", "add", "default", "via", self.gateway_ip)
        self.hosts[name] = h  # before shaping: close() then stops what a failed shape started
        self.shape(h, link)
        return h

    def shape(self, h: Host, link: Link) -> None:
        """(Re)apply `link` to both ends of the host's veth pair: egress from the host, and egress from the bridge
        toward it; loss without netem by the packet filter in the host's namespace."""
        _check_link(link)
        use_netem = link.needs_netem and netem_available()
        self._shape_delay(h, link, use_netem)
        # both directions, each at an ingress: into the host on its veth, out of it on the bridge's end
        for prefix, dev, table in ((h.exec_prefix(), h.veth, "pdlab_loss"), ([], h.peer, f"pdlab_{h.peer}"[:30])):
            subprocess.run([*prefix, "nft", "delete", "table", "netdev", table], capture_output=True)
            if link.loss_pct and not use_netem:
                r = subprocess.run([*prefix, "nft", "-f", "-"], input=_loss_rules(link.loss_pct, dev, table),
                                   text=True, capture_output=True)
                if r.returncode != 0:
                    raise LabUnavailable(f"nft loss rule on {h.name} failed: {(r.stderr or r.stdout).strip()}")
        for prefix, dev in ((h.exec_prefix(), h.veth), ([], h.peer)):
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if use_netem:
                cmd = [*prefix, "tc", "qdisc", "add", "dev", dev, "root", "netem"]
                if link.delay_ms or link.jitter_ms:
                    cmd += ["delay", f"{link.delay_ms}ms"] + ([f"{link.jitter_ms}ms"] if link.jitter_ms else [])
                if link.loss_pct:
                    cmd += ["loss", f"{link.loss_pct}%"]
                if link.rate_bps:
                    cmd += ["rate", f"{link.rate_bps}bit"]
                _run(*cmd)
            elif link.rate_bps:
                _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", *_tbf_args(link.rate_bps))
        h.link = link

    def _shape_delay(self, h: Host, link: Link, use_netem: bool) -> None:
        from pdserve.lab.delay import DelayedLink
        if h.delayed is not None and not use_netem and (link.delay_ms, link.jitter_ms) == (h.link.delay_ms,
                                                                                         h.link.jitter_ms):
            return  # the same delay (a fault changing the loss or the rate): the reader and its queue stay
        if h.delayed is not None:
            h.delayed.close()
            h.delayed = None
        if (link.delay_ms or link.jitter_ms) and not use_netem:
            h.delayed = DelayedLink(h.exec_prefix(), h.veth, link.delay_ms, link.jitter_ms)

    def hold(self, hosts: list[Host], seconds: float) -> Held:
        """A delay spike without netem: every packet to or from `hosts` is held back for about `seconds`, then
        released at the link's rate. Returns how long each link end was held, at least and at most (the `tc`
        commands of each phase run side by side, and each takes effect somewhere within its phase), and how many
        packets the ends held shortly before the release (their queues, read from ~100 ms before it).

        Both ends of each host's veth pair have a token bucket (`Link.rate_bps` must be set). `tc qdisc change`
        keeps a tbf's queue, so the bucket is turned to 8 bit/s with a 16 MiB queue, then back to the link's own
        settings: what is sent meanwhile queues (the first packet of the window waits ~`seconds`, the last hardly
        at all: a stall, not a constant added latency), nothing is dropped unless the queue fills. A change starts
        with a full bucket, so the pause counts 1550 bytes of overhead per packet against a 3100-byte burst: one
        packet per end (of up to 1550 bytes, the veth's MTU fits) slips through as the pause starts. What
        netem's `delay` would add and this does not: the same delay on every packet of the window, and a delay
        on a host whose link is unshaped."""
        import time
        ends = [(ns, dev, h.link) for h in hosts for ns, dev in ((h.ns, h.veth), (None, h.peer))]
        if not all(link.rate_bps for _, _, link in ends):
            raise ValueError("hold needs rate-capped links (their tbf holds the packets)")
        # one `tc -batch` per namespace, started first: each phase is then a write to each, not a process start
        # (on a loaded 2-core box starting 8 `tc`s took ~0.2 s, as long as the spike)
        tcs = {ns: _TcBatch(ns) for ns, _, _ in ends}
        pause = ["rate", "8bit", "burst", "3100", "overhead", "1550", "limit", str(16 << 20)]

        def phase(args_of) -> None:
            for ns, tc in tcs.items():
                tc.send([f"qdisc change dev {dev} root tbf {' '.join(args_of(link))}" for n, dev, link in ends
                         if n == ns])
            for tc in tcs.values():
                tc.wait()

        try:
            t0 = time.monotonic()
            phase(lambda link: pause)
        finally:
            t1 = time.monotonic()
            release = (t0 + t1) / 2 + seconds  # the ends paused within [t0, t1]: centred on `seconds`
            time.sleep(max(0.0, release - 0.1 - t1))
            reading = _queued({ns: [dev for n, dev, _ in ends if n == ns] for ns, _, _ in ends})
            time.sleep(max(0.0, release - time.monotonic()))
            t2 = time.monotonic()
            try:
                phase(lambda link: _tbf_args(link.rate_bps))
            finally:
                t3 = time.monotonic()
                for tc in tcs.values():
                    tc.close()
                queued = reading()  # read while held (started 100 ms before the release), counted now
        return Held(t2 - t1, t3 - t0, queued)

    def cut(self, src: Host, dst: Host, cut: bool = True) -> None:
        """Silently drop every packet `src` sends to `dst`, or stop dropping them; `dst` -> `src` is untouched.

        No packet filter is needed (these kernels have none): a permanent neighbour entry in `src`'s namespace
        points `dst`'s address at a MAC no interface has, so the bridge floods those frames and every host
        ignores them, as a one-way partition looks from both ends (timeouts, not connection errors)."""
        if cut:
            _run(*src.exec_prefix(), "ip", "neigh", "replace", dst.ip, "lladdr", NOWHERE_MAC, "nud", "permanent",
                 "dev", src.veth)
        else:
            subprocess.run([*src.exec_prefix(), "ip", "neigh", "del", dst.ip, "dev", src.veth], capture_output=True)

    def set_down(self, h: Host, down: bool = True) -> None:
        """Cut the host off the bridge (its link down) or bring it back."""
        _run("ip", "link", "set", h.peer, "down" if down else "up")

    def close(self) -> None:
        for h in self.hosts.values():
            if h.delayed is not None:
                h.delayed.close()  # its process outlives the namespace otherwise
                h.delayed = None
        while self._made:
            kind, name = self._made.pop()
            if kind == "netns":
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
