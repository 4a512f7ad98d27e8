"""The role switch's state table (services/role_switch.py): every path the design names, and every step it lacks
refused. The expected paths are written out here from the design, not derived from TABLE."""
import asyncio
import itertools

import pytest

from pdserve.services.role_switch import (
    DRAINING,
    REGISTERING,
    REPARTITIONING,
    RESTORING,
    SERVING,
    SWITCHING,
    TABLE,
    RoleSwitch,
    SwitchRefused,
    drain,
)

EVENTS = ("request", "drained", "timeout", "ready", "failed", "registered")
STATES = (SERVING, DRAINING, REPARTITIONING, REGISTERING, RESTORING)


def _walk(events):
    s = RoleSwitch("prefill")
    s.begin("decode")
    seen = [s.state]
    for ev in events:
        seen.append(s.fire(ev))
    return s, seen


def test_switch_path():
    s, seen = _walk(["drained", "ready"])
    assert seen == [DRAINING, REPARTITIONING, REGISTERING]
    assert not s.accepts_work and s.registry_role == SWITCHING and s.in_progress == "prefill->decode"
    s.finish(switched=True)
    assert (s.state, s.role, s.registry_role, s.in_progress, s.accepts_work) == (SERVING, "decode", "decode", "", True)


@pytest.mark.parametrize("events", [["timeout"], ["drained", "failed"]])
def test_undo_paths_keep_the_old_role(events):
    s, seen = _walk(events)
    assert seen[-1] == RESTORING and not s.accepts_work
    s.finish(switched=False)
    assert (s.state, s.role, s.accepts_work) == (SERVING, "prefill", True)


def test_every_missing_step_is_refused():
    allowed = {(SERVING, "request"), (DRAINING, "drained"), (DRAINING, "timeout"), (REPARTITIONING, "ready"),
               (REPARTITIONING, "failed"), (REGISTERING, "registered"), (RESTORING, "registered")}
    assert set(TABLE) == allowed
    for st, ev in itertools.product(STATES, EVENTS):
        if (st, ev) in allowed:
            continue
        s = RoleSwitch("both")
        s.state = st
        with pytest.raises(SwitchRefused):
            s.fire(ev)
        assert s.state == st  # a refused step changes nothing


def test_begin_refuses_a_second_switch_and_unknown_roles():
    s = RoleSwitch("decode")
    with pytest.raises(SwitchRefused, match="unknown role"):
        s.begin("router")
    assert s.state == SERVING
    s.begin("both")
    with pytest.raises(SwitchRefused, match="in progress"):
        s.begin("prefill")
    assert s.target == "both"


def test_drain_waits_for_held_work_and_times_out():
    held = [2]

    async def go():
        async def release():
            await asyncio.sleep(0.05)
            held[0] = 1
            await asyncio.sleep(0.05)
            held[0] = 0
        t = asyncio.create_task(release())
        ok = await drain(lambda: held[0], timeout_s=2.0, poll_s=0.01)
        await t
        held[0] = 1
        late = await drain(lambda: held[0], timeout_s=0.05, poll_s=0.01)
        return ok, late
    assert asyncio.run(go()) == (True, False)
