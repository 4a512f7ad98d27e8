#!/usr/bin/env bash
# Create .venv and install pdserve with its test tools. CPU torch first, from the pinned release, so that no
# package pulls a multi-GB CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -c "import torch, pdserve; print('pdserve installed; torch', torch.__version__)"
# Compile the engine's native CPU kernels now (~30 s, cached in ~/.cache/torch_extensions) instead of on first use.
.venv/bin/python -c "from pdserve.engine.kernels import native_ops as n, native_unavailable_reason as r; n(); print('native kernels:', r() or 'built')"
# Where the kernel has no netem (docs/lab.md) the lab's link loss needs `nft` and its delay iptables' NFQUEUE target;
# as root, install them if missing.
if [ "$(id -u)" = 0 ] && ! command -v nft >/dev/null && command -v apt-get >/dev/null; then
  apt-get install -y -qq nftables >/dev/null 2>&1 || echo "nftables not installed: the lab refuses link loss"
fi
if [ "$(id -u)" = 0 ] && ! command -v iptables >/dev/null && command -v apt-get >/dev/null; then
  apt-get install -y -qq iptables >/dev/null 2>&1 || echo "iptables not installed: the lab refuses link delay"
fi
