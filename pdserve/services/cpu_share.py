"""An emulated host's CPU: a process capped at a fraction of the machine's cores, by a cgroup CPU quota.

Why: on a GPU cluster every worker has its own accelerator, so a pool's capacity grows with its worker count. Four
workers on a 2-core box instead share the same two cores, and whichever role holds them, two busy workers already
use the whole machine: a static split is never short of workers of one role, only of cores. Capping each worker at
`cores` of CPU time (the host it would have had) makes each worker a fixed unit of capacity again, as the network
namespaces of `lab/netns.py` make each one a host with its own link.

The cap is the kernel's CFS bandwidth control: `cores` x `period` of CPU time per `period` (10 ms here, so a capped
step is throttled in slices of at most a few ms rather than the default 100 ms). cgroup v2 (`cpu.max`) where the
cpu controller is there, v1 (`cpu.cfs_quota_us`) otherwise; root only. A process moves itself in, then execs the
real command (`python -m pdserve.services.cpu_share --cores 0.4 --name w1 -- cmd ...`), so a supervisor that restarts
the command restarts it capped, and its pid is the command's. The group outlives the exec; `remove_groups` (by the
`up` that made them) deletes the empty ones.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

PERIOD_US = 10_000
PREFIX = "pdserve-host-"


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(fstype, mount point, controllers) of every cgroup mount."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _, opts = (right.split() + ["", "", ""])[:3]
        if fstype in ("cgroup", "cgroup2"):
            out.append((fstype, left.split()[4], set(opts.split(","))))
    return out


def cpu_root() -> tuple[str, Path] | None:
    """("v2" | "v1", the directory the groups go under), or None where no cpu controller can be used."""
    for fstype, point, opts in _mounts():
        p = Path(point)
        if fstype == "cgroup2" and "cpu" in (p / "cgroup.controllers").read_text().split():
            return "v2", p
        if fstype == "cgroup" and "cpu" in opts and (p / "cpu.cfs_quota_us").exists():
            return "v1", p
    return None


def out_of_range(cores: float) -> str | None:
    """Why `cores` is no share of this machine (None where it is one)."""
    if cores > (os.cpu_count() or 1):
        return f"{cores} is more than this machine's {os.cpu_count()} CPUs"
    if cores < 0.01:
        return f"{cores} is below the 0.01 CPU the kernel's smallest quota allows here"
    return None


def why_not() -> str | None:
    """Why a CPU cap cannot be set here (None where it can)."""
    if os.geteuid() != 0:
        return "a CPU cap per worker needs root (a cgroup is made per worker)"
    if cpu_root() is None:
        return "a CPU cap per worker needs the kernel's cgroup cpu controller, and no cgroup mount here has it"
    return None


def group(name: str, cores: float) -> Path:
    """The group `name`, made if missing, capped at `cores` CPUs."""
    if (bad := out_of_range(cores)) is not None:
        raise ValueError(f"cores must be in [0.01, {os.cpu_count()}]: {bad}")
    found = cpu_root()
    if found is None:
        raise RuntimeError(why_not() or "no cgroup cpu controller")
    kind, root = found
    g = root / f"{PREFIX}{name}"
    quota = max(1000, round(cores * PERIOD_US))
    if kind == "v2":
        sub = root / "cgroup.subtree_control"
        if "cpu" not in sub.read_text().split():
            sub.write_text("+cpu")
        g.mkdir(exist_ok=True)
        (g / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    else:
        g.mkdir(exist_ok=True)
        (g / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (g / "cpu.cfs_quota_us").write_text(str(quota))
    return g


def enter(g: Path) -> None:
    """Move the calling process, with all its threads, into group `g`."""
    (g / "cgroup.procs").write_text(str(os.getpid()))


def remove_groups(names) -> None:
    """Delete the named groups once empty (best effort: a group still holding a process stays)."""
    found = cpu_root()
    if found is None:
        return
    for n in names:
        try:
            (found[1] / f"{PREFIX}{n}").rmdir()
        except OSError:
            pass


def wrap(cmd: list[str], name: str, cores: float) -> list[str]:
    """`cmd`, started capped at `cores` in group `name`."""
    return [sys.executable, "-m", "pdserve.services.cpu_share", "--cores", repr(cores), "--name", name, "--", *cmd]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.services.cpu_share", description=__doc__.split("\n")[0])
    ap.add_argument("--cores", type=float, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no command after --")
    enter(group(a.name, a.cores))
    os.execvp(cmd[0], cmd)
    return 127  # unreachable: execvp replaces the process or raises


if __name__ == "__main__":
    sys.exit(main())
