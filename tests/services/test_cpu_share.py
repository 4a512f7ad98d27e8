"""A worker capped by `--worker-cpus` (services/cpu_share.py) gets that share of CPU time and no more, keeps its pid
(the wrapper execs), and its group goes away afterwards. CPU time is read from /proc (the kernel's own accounting of
the process), not from the cgroup the code wrote."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.services import cpu_share

pytestmark = pytest.mark.skipif(cpu_share.why_not() is not None, reason=str(cpu_share.why_not()))

SPIN = "import time\nt = time.time()\nwhile time.time() - t < 60: pass\n"


def _cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _shares(cmds: list[list[str]], wall: float = 1.5) -> list[float]:
    """CPU seconds per wall second each of `cmds`, run at once, used over `wall` s (after a 0.3 s start): at once,
    so the capped loop and its uncapped control see the same load from whatever else runs."""
    ps = [subprocess.Popen(c) for c in cmds]
    try:
        time.sleep(0.3)
        c0, t0 = [_cpu_seconds(p.pid) for p in ps], time.monotonic()
        time.sleep(wall)
        dt = time.monotonic() - t0
        return [(_cpu_seconds(p.pid) - c) / dt for p, c in zip(ps, c0)]
    finally:
        for p in ps:
            p.kill()
            p.wait()


@pytest.mark.alone  # a CPU share: measured with the cores to itself (scripts/test.sh's second phase)
def test_a_capped_busy_loop_gets_its_share_and_an_uncapped_one_more():
    name = f"test-{os.getpid()}"
    try:
        for _ in range(3):  # the control needs a free core; the cap is checked on every attempt
            capped, uncapped = _shares([cpu_share.wrap([sys.executable, "-c", SPIN], name, 0.25),
                                        [sys.executable, "-c", SPIN]])
            assert capped <= 0.25 * 1.15, capped   # the quota, with the accounting's tick granularity
            if uncapped >= 0.6:
                break
    finally:
        cpu_share.remove_groups([name])
    assert capped >= 0.25 * 0.6, capped           # and it did run
    assert uncapped >= 0.6, uncapped              # the control: the same loop is not slow by itself
    _, root = cpu_share.cpu_root()
    assert not (root / f"{cpu_share.PREFIX}{name}").exists()


def test_the_wrapper_execs_so_the_pid_is_the_commands(tmp_path):
    name = f"test-pid-{os.getpid()}"
    out = tmp_path / "pid"
    p = subprocess.Popen(cpu_share.wrap([sys.executable, "-c", f"import os; open({str(out)!r}, 'w').write("
                                         "str(os.getpid()))"], name, 0.5))
    try:
        assert p.wait(30) == 0
    finally:
        cpu_share.remove_groups([name])
    assert int(out.read_text()) == p.pid


def test_a_share_outside_the_machine_is_refused():
    with pytest.raises(ValueError, match="cores must be in"):
        cpu_share.group("never-made", (os.cpu_count() or 1) + 1)


def test_up_refuses_more_cpus_per_worker_than_the_machine_has():
    r = subprocess.run([sys.executable, "-m", "pdserve", "up", "--model", "builtin", "--worker-cpus",
                        str((os.cpu_count() or 1) * 2), "--port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--worker-cpus" in r.stderr and "more than this machine" in r.stderr

