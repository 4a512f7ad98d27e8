"""The torch-free checkpoint reader the gateway uses agrees with the engine's ModelConfig and refuses the same
broken directories."""
from __future__ import annotations

import json

import pytest

from pdserve.engine.checkpoint import resolve_model_dir, serving_limits
from pdserve.engine.config import ModelConfig
from pdserve.engine.errors import CheckpointError


def test_limits_match_the_engine(tiny_llama):
    for d in (tiny_llama, resolve_model_dir("builtin")):
        m = ModelConfig.from_dir(d)
        lim = serving_limits(d)
        assert (lim.vocab_size, lim.max_model_len) == (m.vocab_size, m.max_model_len)
    assert serving_limits(tiny_llama).max_model_len == 512  # tests/conftest.py: max_position_embeddings


@pytest.mark.parametrize("config,why", [(None, "missing config.json"), ("{", "malformed JSON"),
                                        ({"architectures": ["GPT2"]}, "unsupported architecture"),
                                        ({"architectures": ["LlamaForCausalLM"]}, "missing or invalid field")])
def test_broken_checkpoints_are_refused_like_the_engine(tmp_path, config, why):
    if config is not None:
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for read in (serving_limits, ModelConfig.from_dir):
        with pytest.raises(CheckpointError, match=why):
            read(tmp_path)
