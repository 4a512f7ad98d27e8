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
# Preparing wheels/ on a machine with network, for the GPU host's Python (here 3.12) and platform (~55 MiB):
#   pip download --only-binary=:all: --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     --platform manylinux2014_x86_64 -d wheels/ \
#     numpy tokenizers safetensors "transformers>=5.0" huggingface-hub pyyaml regex tqdm packaging filelock \
#     fsspec typing-extensions jinja2 markupsafe "xgrammar==0.2.9" apache-tvm-ffi pydantic pydantic-core \
#     annotated-types typing-inspection
# (nixl-cu12 is ~50 MiB more: carry it only if the budget allows; without it the nixl line is skipped.)
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
