"""A checkpoint directory and its config.json, read without torch: what the gateway needs (the vocabulary and
context sizes, the tokenizer's directory) and the checks `ModelConfig.from_dir` builds on. The gateway and the
router import this, never the engine (docs/services.md, "Slim processes")."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.architectures import SUPPORTED_ARCHITECTURES
from pdserve.engine.errors import CheckpointError


def resolve_model_dir(model: str | Path) -> Path:
    if str(model) == "builtin":
        from pdserve.builtin import builtin_model_dir
        return builtin_model_dir()
    return Path(model)


def read_config(model_dir: str | Path) -> tuple[Path, dict, str]:
    """(config.json's path, its contents, the architecture), or CheckpointError saying what is wrong."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a checkpoint directory")
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: missing config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from e
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return path, cfg, arch


def need_int(path: Path, cfg: dict, name: str) -> int:
    try:
        return int(cfg[name])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: missing or invalid field {name!r} ({cfg.get(name)!r})") from None


def max_position_embeddings(cfg: dict) -> int:
    return int(cfg.get("max_position_embeddings", 2048))


@dataclass(frozen=True)
class ServingLimits:
    """What a request is checked against before it reaches a worker."""
    vocab_size: int
    max_model_len: int


def serving_limits(model_dir: str | Path) -> ServingLimits:
    path, cfg, _ = read_config(model_dir)
    try:
        return ServingLimits(need_int(path, cfg, "vocab_size"), max_position_embeddings(cfg))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: missing or invalid field {e}") from e
