from __future__ import annotations

import json
import random
import statistics

from pdserve.bench.workload import LengthDist, PromptMaker, arrivals, load_trace, synthetic


def test_poisson_and_gamma_rates_and_burstiness():
    n = 4000
    for proc, cv in (("poisson", 1.0), ("gamma", 3.0), ("gamma", 0.5)):
        t = arrivals(n, 5.0, random.Random(1), proc, cv)
        gaps = [b - a for a, b in zip(t, t[1:])]
        m = statistics.mean(gaps)
        assert abs(m - 0.2) / 0.2 < 0.12, (proc, cv, m)
        assert abs(statistics.pstdev(gaps) / m - cv) / cv < 0.2, (proc, cv)
    assert arrivals(5, 2.0, random.Random(0), "constant") == [0.0, 0.5, 1.0, 1.5, 2.0]


def test_seeded_schedule_is_reproducible():
    a = synthetic(50, 3.0, LengthDist.parse("uniform:5:20"), LengthDist.parse("lognormal:16:0.5:64"), seed=4)
    b = synthetic(50, 3.0, LengthDist.parse("uniform:5:20"), LengthDist.parse("lognormal:16:0.5:64"), seed=4)
    assert [(s.arrival, s.prompt, s.output_len) for s in a] == [(s.arrival, s.prompt, s.output_len) for s in b]
    assert all(5 <= len(s.prompt) == s.prompt_len <= 20 and 1 <= s.output_len <= 64 for s in a)


def test_shared_prefix_and_tenants():
    mk = PromptMaker("ids", (3, 100), shared_prefix_len=8, shared_prefix_frac=1.0, tenants=2)
    specs = synthetic(6, 1.0, LengthDist.parse(12), LengthDist.parse(4), seed=0, maker=mk)
    t0 = [s.prompt[:8] for s in specs if s.tenant == 0]
    t1 = [s.prompt[:8] for s in specs if s.tenant == 1]
    assert all(p == t0[0] for p in t0) and all(p == t1[0] for p in t1) and t0[0] != t1[0]
    assert all(len(s.prompt) == 12 for s in specs)


def test_traces_jsonl_and_sharegpt(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [{"timestamp": 10.0, "prompt_len": 7, "output_len": 3},
                                                   {"timestamp": 10.5, "prompt": "judge my vow", "output_len": 5}]))
    specs = load_trace(p)
    assert [s.arrival for s in specs] == [0.0, 0.5]
    assert len(specs[0].prompt) == 7 and specs[0].output_len == 3 and specs[1].prompt == "judge my vow"
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hello there friend"},
                                                 {"from": "gpt", "value": "one two three four five six"}]}]))
    specs = load_trace(sg, rate=2.0, chat=True)
    assert specs[0].prompt == "hello there friend" and specs[0].output_len == round(6 * 1.3)
    assert specs[0].messages == [{"role": "user", "content": "hello there friend"}]
