"""`pdserve up --worker-cpus X` (services/cpu_share.py): each worker of a real deployment runs in its own cgroup at
the quota, under its own pid, the other services in none, and `up` leaves no group behind."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.services import cpu_share

pytestmark = pytest.mark.skipif(cpu_share.why_not() is not None, reason=str(cpu_share.why_not()))


def test_up_runs_each_worker_capped_in_its_own_group_and_removes_the_groups(tiny_llama):
    from pdserve.services.up_process import UpProcess
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PDSERVE_LOG_LEVEL": "WARNING"}
    up = UpProcess(["--model", str(tiny_llama), "--num-gpu-blocks", "64", "--mode", "disagg", "--prefill", "1",
                    "--decode", "1", "--worker-cpus", "0.5"], env, 180)
    _, root = cpu_share.cpu_root()
    try:
        groups = {}
        for w in up.workers():
            g = root / f"{cpu_share.PREFIX}{w['worker_id']}"
            assert str(w["pid"]) in (g / "cgroup.procs").read_text().split()  # the worker's own pid: exec'd in place
            groups[w["role"]] = g
            quota = ((g / "cpu.max").read_text().split()[0] if (g / "cpu.max").exists()
                     else (g / "cpu.cfs_quota_us").read_text().strip())
            assert int(quota) == cpu_share.PERIOD_US // 2
        assert set(groups) == {"prefill", "decode"}
        router = next(p for p in up.info["processes"] if p["name"] == "router")
        assert cpu_share.PREFIX not in Path(f"/proc/{router['pid']}/cgroup").read_text()  # only workers are hosts
    finally:
        assert up.stop() == 0
    assert not any(g.exists() for g in groups.values())
