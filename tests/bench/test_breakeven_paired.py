"""The paired TTFT phase (pdserve/bench/breakeven_paired.py): every mode gets the same isolated prompts, one
request at a time, in a rotated order, and every deployment it started is stopped, also when a request fails."""
import types

import pytest

from pdserve.bench import breakeven, breakeven_paired


class _Dep:
    def __init__(self, mode, log):
        self.base_url, self.mode, self.log = f"http://{mode}", mode, log

    def stop(self):
        self.log.append(("stop", self.mode))


def _args(**kw):
    return types.SimpleNamespace(**{"seed": 0, "isolated_requests": 6, "token_range": "3:250", "slo_ttft": 0.5,
                                    "slo_tpot": 0.05, **kw})


def test_every_mode_the_same_prompts_alternated_and_rotated(monkeypatch):
    log, calls = [], []
    monkeypatch.setattr(breakeven, "start_mode", lambda a, m: (_Dep(m, log), {}))
    ttft = {"colocated": 0.030, "disagg@10gbit": 0.032, "auto@10gbit": 0.031}

    def fake(url, spec):
        mode = url.removeprefix("http://")
        calls.append((mode, tuple(spec.prompt)))
        return {"ttft": ttft[mode], "path": ttft[mode] - 0.025}
    monkeypatch.setattr(breakeven_paired, "_one", fake)
    modes = list(ttft)
    out = breakeven_paired.measure(_args(), modes, [(32, 4)])
    measured = calls[2 * len(modes):]  # after two warm-up requests per mode
    prompts = [p for _, p in measured[::3]]
    assert len(set(prompts)) == 6  # distinct prompts
    for i in range(6):
        turn = measured[3 * i: 3 * i + 3]
        assert {p for _, p in turn} == {prompts[i]}  # the same prompt to every mode in turn
        assert [m for m, _ in turn] == modes[i % 3:] + modes[:i % 3]  # rotated: no mode always goes first
    for m in modes:
        assert out[m]["32x4"]["n"] == 6 and out[m]["32x4"]["ttft_s"] == pytest.approx(ttft[m])
        assert out[m]["32x4"]["path_s"] == pytest.approx(ttft[m] - 0.025)
    assert sorted(x for _, x in log) == sorted(modes)


def test_deployments_are_stopped_when_a_request_fails(monkeypatch):
    log = []
    monkeypatch.setattr(breakeven, "start_mode", lambda a, m: (_Dep(m, log), {}))

    def boom(url, spec):
        raise RuntimeError("gateway went away")
    monkeypatch.setattr(breakeven_paired, "_one", boom)
    with pytest.raises(RuntimeError):
        breakeven_paired.measure(_args(), ["colocated", "disagg"], [(32, 4)])
    assert sorted(x for _, x in log) == ["colocated", "disagg"]
