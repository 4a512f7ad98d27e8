"""pdserve/services/supervisor.py with real child processes (small Python programs): restart with backoff, counted
and announced; no restart when off; stop = SIGTERM then SIGKILL after the grace; children die with their parent
(PR_SET_PDEATHSIG), even when the parent is SIGKILLed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.services.supervisor import BACKOFF_FIRST_S, Supervisor

PY = sys.executable


def _sup(restart: bool = True) -> tuple[Supervisor, list[str], list[str]]:
    logs, announced = [], []
    return Supervisor(dict(os.environ), restart=restart, log=logs.append, announce=announced.append), logs, announced


def _poll_until(sup: Supervisor, cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sup.poll()
        if cond():
            return True
        time.sleep(0.02)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not yet reaped by its parent) counts as gone: it holds no port and runs nothing
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_crashing_child_restarted_with_doubling_backoff():
    sup, logs, announced = _sup()
    c = sup.start("crasher", [PY, "-c", "import sys; sys.exit(3)"], {"port": 1234})
    starts = [time.monotonic()]
    pids = [c.proc.pid]

    def restarted_3_times() -> bool:
        if c.proc.pid != pids[-1]:
            pids.append(c.proc.pid)
            starts.append(time.monotonic())
        return c.restarts >= 3

    assert _poll_until(sup, restarted_3_times, 20), logs
    sup.stop_all(2)
    assert len(set(pids)) == 4  # each restart is a new process
    # delays between starts: the process's own run time + 0.5, 1, 2 s
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    for gap, backoff in zip(gaps, (BACKOFF_FIRST_S, 2 * BACKOFF_FIRST_S, 4 * BACKOFF_FIRST_S)):
        assert gap >= backoff, (gaps, backoff)
    assert [h["code"] for h in c.history[:3]] == [3, 3, 3]
    # every restart counted, logged and announced with the new pid
    assert sum("restarted crasher" in m for m in logs) == 3
    last = json.loads(announced[2][len("PDSERVE_CHILD "):])
    assert last["name"] == "crasher" and last["restarts"] == 3 and last["last_exit"] == 3 and last["port"] == 1234
    assert last["pid"] == pids[3] == c.info["pid"]
    assert any("exited with code 3" in m and "restart 1 in 0.5 s" in m for m in logs), logs


def test_killed_child_restarted_then_stop_is_final():
    sup, logs, _ = _sup()
    c = sup.start("sleeper", [PY, "-c", "import time; time.sleep(60)"])
    first = c.proc.pid
    os.kill(first, signal.SIGKILL)
    assert _poll_until(sup, lambda: c.restarts == 1 and c.running, 10), logs
    assert c.proc.pid != first and c.last_exit == -signal.SIGKILL
    assert any("signal SIGKILL" in m for m in logs), logs
    sup.stop("sleeper", 5)
    time.sleep(BACKOFF_FIRST_S + 0.2)
    sup.poll()
    assert not c.running and c.restarts == 1  # stopped on purpose: not restarted


def test_no_restart_leaves_the_death():
    sup, logs, announced = _sup(restart=False)
    c = sup.start("once", [PY, "-c", "pass"])
    assert _poll_until(sup, lambda: sup.dead() is c, 10)
    time.sleep(BACKOFF_FIRST_S + 0.2)
    assert sup.poll() == [] and c.restarts == 0 and not announced
    assert any("not restarted" in m for m in logs)


def test_stop_drains_then_kills_after_grace():
    sup, logs, _ = _sup()
    # drains: exits 0 on SIGTERM
    sup.start("polite", [PY, "-c", "import signal, sys, time\n"
                                  "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
                                  "print('ready', flush=True)\ntime.sleep(60)"])
    # ignores SIGTERM: SIGKILL after the grace
    stubborn = sup.start("stubborn", [PY, "-c", "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                      "time.sleep(60)"])
    time.sleep(1.0)  # both have installed their handlers
    assert sup.stop("polite", 5) == 0
    t0 = time.monotonic()
    assert sup.stop("stubborn", 1.0) == -signal.SIGKILL
    assert 0.9 <= time.monotonic() - t0 < 5
    assert not stubborn.running and any("SIGKILL" in m for m in logs)
    sup.remove("stubborn")
    assert list(sup.children) == ["polite"]
    with pytest.raises(ValueError):
        sup.start("polite", [PY, "-c", "pass"])


PARENT = """
import os, sys, time
from pdserve.services.supervisor import Supervisor
sup = Supervisor(dict(os.environ))
c = sup.start("child", [sys.executable, "-c", "import time; time.sleep(120)"])
print(c.proc.pid, flush=True)
while True:
    sup.poll()
    time.sleep(0.1)
"""


def test_children_die_with_a_sigkilled_parent():
    """The parent (what `pdserve up` is) SIGKILLed: its child, in its own session (a group kill of the parent
    does not reach it), is gone within moments through its parent-death signal."""
    parent = subprocess.Popen([PY, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        assert _alive(child) and os.getpgid(child) != os.getpgid(parent.pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        end = time.monotonic() + 5
        while _alive(child) and time.monotonic() < end:
            time.sleep(0.02)
        assert not _alive(child), "the child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_drain_is_nonblocking_kills_at_the_deadline_and_forgets_the_child():
    """How the planner removes a worker: `drain` returns at once; a child that ignores SIGTERM is SIGKILLed by
    `poll` at the deadline, never restarted, and then gone from the table; one that drains is forgotten too."""
    sup, logs, _ = _sup(restart=True)
    stubborn = sup.start("stubborn", [PY, "-c", "import signal, time; "
                                                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
    sup.start("polite", [PY, "-c", "import time; time.sleep(60)"])
    time.sleep(0.5)  # both installed their handlers
    t0 = time.monotonic()
    sup.drain("stubborn", grace=1.0)
    sup.drain("polite", grace=30.0)
    assert time.monotonic() - t0 < 0.5
    assert {c.name for c in sup.draining()} == {"stubborn", "polite"}
    assert _poll_until(sup, lambda: "polite" not in sup.children, 5.0)
    assert "stubborn" in sup.children and stubborn.running  # ignoring SIGTERM, before its deadline
    assert _poll_until(sup, lambda: "stubborn" not in sup.children, 5.0)
    assert time.monotonic() - t0 >= 1.0
    assert stubborn.proc.returncode == -signal.SIGKILL
    assert not any("restarted" in line for line in logs)
    assert sup.dead() is None
