"""Native CPU kernels, compiled on first use with torch's C++ extension builder (g++ and ninja).

Only what torch cannot express without extra passes over memory lives here: decode attention read in place from
the paged KV pool (csrc/paged_attention.cpp), SwiGLU's silu(gate) * up in one pass (csrc/silu_and_mul.cpp), and
RMSNorm and in-place rotary embedding (csrc/norm_rope.cpp), whose torch forms are several small ops each, and a
greedy step's per-row argmax + log-sum-exp in one kernel (csrc/row_stats.cpp), and causal prefill attention over
the pool for bf16 on AVX-512 (csrc/prefill_attention.cpp; SDPA stays the path elsewhere).
Every kernel has a pure-torch twin in attention.py that the tests
compare it against; when the build is impossible (no compiler, `PDSERVE_NATIVE_KERNELS=0`, a non-CPU device) the
engine uses the twin and says so once in its log.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)
_lock = threading.Lock()
_module = None
_failed: str | None = None


def native_ops():
    """The compiled module, or None when it cannot be built here (the reason is logged once)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if os.environ.get("PDSERVE_NATIVE_KERNELS", "1") == "0":
            _failed = "disabled by PDSERVE_NATIVE_KERNELS=0"
            return None
        try:
            from torch.utils.cpp_extension import load
            try:  # torch runs `ninja` from PATH; the pip package's binary sits in an unactivated venv's bin
                import ninja
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                pass
            csrc = Path(__file__).parent / "csrc"
            sources = [str(csrc / f) for f in ("bindings.cpp", "paged_attention.cpp", "silu_and_mul.cpp",
                                                     "norm_rope.cpp", "row_stats.cpp", "prefill_attention.cpp")]
            # -march=native: the extension is built on the machine that runs it (cached per source hash).
            _module = load(name="pdserve_cpu_kernels", sources=sources,
                           # Reassociation lets g++ vectorise the fp32 dot products and sums (no NaN/inf assumptions).
                           extra_cflags=["-O3", "-march=native", "-fopenmp", "-fassociative-math",
                                         "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno"],
                           extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # no compiler / ninja / headers: fall back, loudly
            _failed = f"{type(e).__name__}: {e}"
            log.warning("native kernels unavailable, using the torch path: %s", _failed[:500])
        return _module


def native_unavailable_reason() -> str | None:
    native_ops()
    return _failed
