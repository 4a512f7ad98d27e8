#!/usr/bin/env bash
# The GPU check of issue 16: one table (greedy vs transformers, decode step vs the HBM bound, mixed workload vs
# transformers, NIXL VRAM->VRAM), in under 8 minutes on one GPU. bench/gpu_check.py says what each line measures.
#
#   bash scripts/gpu_check.sh [--dry-run] [--budget-s 450]
#
# The host needs only Python, torch (CUDA build, >= 2.11) and Triton (>= 3.6); it needs no network. pdserve runs
# from this checkout (PYTHONPATH), and every other package comes from wheels carried with it in wheels/ (git-
# ignored), unpacked into .gpu-site/ on first run. Lines whose packages are missing say "skipped: <why>".
#
# Preparing wheels/ on a machine with network, for the GPU host's Python (e.g. 3.12) and platform: the closure
# of what the engine and the transformers reference import, less what torch already brings (filelock, fsspec,
# jinja2, markupsafe, sympy, networkx, typing-extensions); about 45 MiB of wheels:
#   pip download --only-binary=:all: --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 -d wheels/ \
#     numpy "transformers>=5.0" tokenizers safetensors huggingface-hub hf-xet pyyaml regex tqdm packaging \
#     typer click rich markdown-it-py mdurl pygments shellingham annotated-doc httpx2 httpcore2 h11 anyio idna \
#     truststore "xgrammar==0.2.9" apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
# (the names and versions are what `pip install -e .` resolved next to transformers 5.24 / xgrammar 0.2.9;
# nixl-cu12 is ~50 MiB more: carry it only if the budget allows; without it the nixl line says why.)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
SITE=.gpu-site
if compgen -G "wheels/*.whl" >/dev/null; then
  mkdir -p "$SITE"
  for w in wheels/*.whl; do  # a wheel is a zip laid out for site-packages: unpacking it is installing it
    stamp="$SITE/.unpacked-$(basename "$w")"
    [ -e "$stamp" ] || { "$PY" -m zipfile -e "$w" "$SITE" && touch "$stamp"; }
  done
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}:$PWD/$SITE"
# The table is printed even if a check hangs: the driver stops starting checks after --budget-s; this is the
# hard stop (8 minutes) for one that never returns.
exec timeout -k 10 470 "$PY" bench/gpu_check.py "$@"
