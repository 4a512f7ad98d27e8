"""Role switches in place of start + drain (planner/switching.py): min(growth, shrink) workers move, the rest is
scaled; anything else is left to scaling. Expected values are worked out by hand from the verdicts."""
from pdserve.planner.guard_rails import PoolVerdict
from pdserve.planner.switching import SwitchCosts, drain_estimate, plan_switches


def V(pool, cur, want):
    return PoolVerdict(pool, cur, want, "r")


def test_one_grows_one_shrinks_switches_the_overlap():
    moves, left = plan_switches([V("prefill", 1, 3), V("decode", 3, 2)])
    assert moves == [("decode", "prefill")]
    assert [(v.pool, v.current, v.desired, v.action) for v in left] == [("prefill", 2, 3, "up"),
                                                                        ("decode", 2, 2, "hold")]
    moves, left = plan_switches([V("prefill", 3, 1), V("decode", 1, 3)])
    assert moves == [("prefill", "decode")] * 2 and all(v.action == "hold" for v in left)


def test_no_switch_unless_one_up_and_one_down():
    for pools in ([V("prefill", 1, 2), V("decode", 1, 2)], [V("prefill", 2, 1), V("decode", 2, 2)],
                  [V("prefill", 1, 1), V("decode", 1, 1)]):
        moves, left = plan_switches(pools)
        assert moves == [] and left == pools


def test_switch_only_where_it_beats_a_new_worker():
    """Decode drain ~ one output at the TPOT SLO: 100 tokens x 0.05 s = 5 s, + 0.5 s switch = 5.5 s. Against a
    30 s start the switch pays; against a 3 s start a new prefill worker is started instead (and the decode pool
    drained). A prefill worker drains ~ a TTFT (0.5 s): 1.0 s < 3 s, so that direction still switches."""
    drains = drain_estimate(100, 0.5, 0.05)
    assert drains == {"prefill": 0.5, "decode": 5.0}
    pools = [V("prefill", 1, 2), V("decode", 3, 2)]
    moves, _ = plan_switches(pools, SwitchCosts(0.5, 30.0, drains))
    assert moves == [("decode", "prefill")]
    moves, left = plan_switches(pools, SwitchCosts(0.5, 3.0, drains))
    assert moves == [] and left == pools
    moves, _ = plan_switches([V("prefill", 2, 1), V("decode", 2, 3)], SwitchCosts(0.5, 3.0, drains))
    assert moves == [("prefill", "decode")]
