"""Constrained decoding end to end on the built-in model: every seeded JSON-schema request parses and validates."""
from __future__ import annotations

import json

import jsonschema

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                        "maximum": 120},
                   "happy": {"type": "boolean"}},
    "required": ["name", "age", "happy"],
    "additionalProperties": False,
}


def test_json_schema_on_builtin_model_20_seeds():
    eng = Engine.from_pretrained("builtin", EngineConfig(kv_cache_bytes=64 << 20))
    prompt = eng.tokenizer.encode(eng.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON."}]), add_special_tokens=False)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=120,
                             guided=GuidedSpec(json_schema=json.dumps(SCHEMA))) for s in range(20)]
    outs = eng.generate([prompt] * 20, params)
    texts = [o.outputs[0].text for o in outs]
    for o, text in zip(outs, texts):
        assert o.outputs[0].finish_reason == "stop", text  # ended because the grammar accepted
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1  # sampled, not one forced string
    assert eng.block_manager.blocks_in_use == 0
