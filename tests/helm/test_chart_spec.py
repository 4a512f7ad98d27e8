"""Speculative decoding on the worker pools: chart values -> `pdserve worker` flags -> EngineConfig."""
from __future__ import annotations

from tests.helm._chart import FULL, by_kind, objects, parse_pdserve, pod_template


def _engine_config(values, pool, monkeypatch):
    from pdserve.services.worker import engine_config_from_args
    objs = objects(values)
    ws = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    return engine_config_from_args(parse_pdserve(pod_template(ws[f"{FULL}-{pool}"])["containers"][0], monkeypatch))


def test_decode_pool_speculates_when_set(monkeypatch):
    cfg = _engine_config({"mode": "disagg", "decode": {"speculative": {
        "method": "draft", "numTokens": 6, "draftModel": "/models/draft"}}}, "decode", monkeypatch)
    assert (cfg.speculative, cfg.num_speculative_tokens, cfg.draft_model) == ("draft", 6, "/models/draft")
    assert _engine_config({"mode": "disagg"}, "decode", monkeypatch).speculative is None  # off by default


def test_colocated_pool_ngram(monkeypatch):
    cfg = _engine_config({"mode": "colocated", "worker": {"speculative": {"method": "ngram"}}}, "worker",
                         monkeypatch)
    assert cfg.speculative == "ngram" and cfg.num_speculative_tokens == 4 and cfg.draft_model is None
