#!/usr/bin/env bash
# Fills wheels/ (git-ignored) with what scripts/gpu_check.sh needs on an offline GPU host beyond what that host has,
# so the checkout can travel there with them (carry "wheels"); gpu_check.sh unpacks them into .gpu-site/.
#
#   bash scripts/gpu_wheels.sh [--bare] [--python 3.12] [--cuda 13]
#
# Default: the lent H200 machine's image, which already holds torch 2.11+cu130, Triton 3.6, transformers,
# tokenizers, safetensors, numpy, jinja2, pyyaml, grpcio, protobuf, rich... (/work/.library/device/KINDS.md); it
# lacks xgrammar (and its tvm-ffi), pydantic and NIXL. --bare: a host with only torch and Triton (the least a
# GPU host is assumed to have): the whole closure of the engine and the transformers reference, less what torch brings.
#
# NIXL is the wheel for the host's CUDA major (nixl-cu13 for torch +cu130), trimmed of nixl_ep_* (expert-parallel
# torch extensions, ~27 MiB of the 56, which pdserve never imports) so that it fits the 64 MiB a device call
# carries. The total is checked against --budget-mib (the checkout itself is ~20 MiB of that).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=3.12 CUDA=13 BARE=0 BUDGET=42
while [ $# -gt 0 ]; do
  case $1 in
    --bare) BARE=1 ;;
    --python) PYVER=$2; shift ;;
    --cuda) CUDA=$2; shift ;;
    --budget-mib) BUDGET=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
# Versions as pyproject.toml resolves them today; pydantic-core must be the one this pydantic names.
PKGS=("xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2" "pydantic==2.14.4" "pydantic-core==2.50.5"
      "annotated-types==0.8.0" "typing-inspection==0.4.5" "nixl-cu$CUDA==1.5.1")
if [ "$BARE" = 1 ]; then
  PKGS+=(numpy "transformers>=5.0" tokenizers safetensors huggingface-hub hf-xet pyyaml regex tqdm packaging typer
         click rich markdown-it-py mdurl pygments shellingham annotated-doc httpx2 httpcore2 h11 anyio idna truststore)
fi
rm -rf wheels && mkdir -p wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d wheels "${PKGS[@]}"
"$PY" - "$BUDGET" <<'EOF'
import sys, zipfile
from pathlib import Path
for w in Path("wheels").glob("nixl_cu*.whl"):  # rewrite without the expert-parallel extensions
    trimmed = w.with_suffix(".trim")
    with zipfile.ZipFile(w) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if not item.filename.split("/")[0].startswith("nixl_ep_"):
                dst.writestr(item, src.read(item))
    trimmed.replace(w)
total = sum(p.stat().st_size for p in Path("wheels").glob("*.whl"))
for p in sorted(Path("wheels").glob("*.whl")):
    print(f"{p.stat().st_size / 2**20:6.1f} MiB  {p.name}")
print(f"{total / 2**20:6.1f} MiB in wheels/ (budget {sys.argv[1]} MiB)")
sys.exit(0 if total <= float(sys.argv[1]) * 2**20 else 1)
EOF
