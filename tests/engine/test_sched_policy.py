"""The scheduling policy table (engine/sched_policy.py): names, a clear error, looked up once by the scheduler."""
from __future__ import annotations

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import POLICIES, EngineConfig
from pdserve.engine.sched_policy import SCHEDULING_POLICIES, scheduling_policy
from pdserve.engine.scheduler import Scheduler


def test_table_lists_the_policies_the_config_accepts():
    assert POLICIES == ("fcfs", "decode-priority", "prefill-priority", "priority", "shortest-predicted-first")
    assert tuple(SCHEDULING_POLICIES) == POLICIES
    assert all(p.name == n for n, p in SCHEDULING_POLICIES.items())


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="'lifo'.*fcfs, decode-priority, prefill-priority, priority, "
                                         "shortest-predicted-first"):
        scheduling_policy("lifo")
    with pytest.raises(ValueError, match="one of fcfs"):
        EngineConfig(policy="lifo").validate()


def test_scheduler_looks_its_policy_up_once():
    cfg = EngineConfig(policy="prefill-priority", num_gpu_blocks=8)
    sch = Scheduler(cfg, BlockManager(8, 16))
    assert sch.policy is SCHEDULING_POLICIES["prefill-priority"] and sch.policy.prefill_first
    assert not SCHEDULING_POLICIES["decode-priority"].prefill_first
