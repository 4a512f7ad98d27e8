"""The built-in demo model: a tiny Llama trained on Debian's fortunes, shipped in `model/`.

`pdserve generate --model builtin` / `pdserve up --model builtin` resolve to `builtin_model_dir()`.
The checkpoint is produced by `python -m pdserve.builtin.train --out pdserve/builtin/model`.
"""
from __future__ import annotations

import pathlib

BUILTIN_NAME = "builtin"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def builtin_model_dir() -> pathlib.Path:
    """Directory of the shipped demo checkpoint; FileNotFoundError naming what is missing otherwise."""
    # package-data (pyproject: "pdserve.builtin" = ["model/*"]) sits next to this file in wheels,
    # editable installs and the source tree alike.
    path = pathlib.Path(__file__).resolve().parent / "model"
    if not path.is_dir():
        raise FileNotFoundError(
            f"the built-in demo model is missing: {path} does not exist. Reinstall pdserve, or rebuild it with "
            "`python -m pdserve.builtin.train --out pdserve/builtin/model` (needs Debian's `fortunes` package)."
        )
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the built-in demo model at {path} is incomplete (missing {', '.join(missing)}). Reinstall pdserve, or "
            "rebuild it with `python -m pdserve.builtin.train --out pdserve/builtin/model`."
        )
    return path
