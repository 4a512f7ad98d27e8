#!/usr/bin/env bash
# The GPU check: one table (greedy vs transformers, decode step vs the HBM bound, mixed workload vs
# transformers, NIXL VRAM->VRAM), in under 8 minutes on one GPU. bench/gpu_check.py says what each line measures
# (its checks: bench/gpu_checks/, one module per subject).
#
#   bash scripts/gpu_check.sh [--dry-run] [--budget-s 450]
#
# The host needs only Python, torch (CUDA build, >= 2.11) and Triton (>= 3.6); it needs no network. pdserve runs
# from this checkout (PYTHONPATH), and every other package comes from wheels carried with it in wheels/ (git-
# ignored), unpacked into .gpu-site/ on first run. Lines whose packages are missing say "skipped: <why>".
#
# Preparing wheels/ (on a machine with the package index, before the device call): `bash scripts/gpu_wheels.sh`
# fetches what the lent H200 image lacks (xgrammar, tvm-ffi, pydantic, nixl-cu13 trimmed to ~29 MiB: ~37 MiB in
# all, for Python 3.12); `--bare` adds what a host with only torch and Triton lacks. Then carry "wheels":
#   run(command="bash scripts/gpu_check.sh", carry=["wheels"], timeout_s=540)
# Checked without a GPU in a Python 3.12 venv holding only the image's packages (torch 2.11.0+cu130 wheel,
# Triton 3.6, transformers 5.17, numpy 2.5): `PYTHON=<venv>/bin/python bash scripts/gpu_check.sh --device cpu
# --tiny` ran every line.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")' 2>/dev/null || echo none)
SITE=.gpu-site/$TAG
if compgen -G "wheels/*.whl" >/dev/null; then
  mkdir -p "$SITE"
  for w in wheels/*.whl; do  # a wheel is a zip laid out for site-packages: unpacking it is installing it
    case $(basename "$w") in  # a compiled wheel for another Python would shadow a working package with a broken one
      *-cp3*) [[ $(basename "$w") == *-"$TAG"-* ]] || { echo "not unpacked (not $TAG): $w" >&2; continue; } ;;
    esac
    stamp="$SITE/.unpacked-$(basename "$w")"
    [ -e "$stamp" ] || { "$PY" -m zipfile -e "$w" "$SITE" && touch "$stamp"; }
  done
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}:$PWD/$SITE"
# The table is printed even if a check hangs: the driver stops starting checks after --budget-s; this is the
# hard stop (8 minutes) for one that never returns.
exec timeout -k 10 470 "$PY" bench/gpu_check.py "$@"
