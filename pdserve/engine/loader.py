"""Read safetensors weights (single file or sharded index) into a state dict by HF parameter name."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.errors import CheckpointError


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed sharded index ({e})") from e
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) named in the index are missing: {', '.join(missing)}")
        return files
    if single.is_file():
        return [single]
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_state_dict(model_dir: str | Path) -> tuple[dict[str, torch.Tensor], str]:
    """Return (tensors by name, a digest of the files' headers and sizes used in the model fingerprint)."""
    model_dir = Path(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    digest = hashlib.blake2b(digest_size=8)
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from e
        digest.update(path.name.encode())
        digest.update(str(path.stat().st_size).encode())
        with open(path, "rb") as fh:  # the header names every tensor's dtype, shape and offsets
            n = int.from_bytes(fh.read(8), "little")
            digest.update(fh.read(min(n, 1 << 20)))
            # Plus 64 samples of 4 KiB spread over the data: checkpoints with equal shapes but different
            # weights get different fingerprints without hashing gigabytes at start-up.
            size = path.stat().st_size
            for k in range(64):
                fh.seek(8 + n + (size - 8 - n) * k // 64)
                digest.update(fh.read(4096))
    return tensors, digest.hexdigest()


def take(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"checkpoint is missing tensor {name!r}")
    t = tensors[name]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, config implies {tuple(shape)}")
    return t
