"""Native CPU kernels, compiled on first use with torch's C++ extension builder (g++ and ninja).

Only what torch cannot express without extra passes over memory lives here: decode attention read in place from
the paged KV pool (csrc/paged_attention.cpp), SwiGLU's silu(gate) * up in one pass (csrc/silu_and_mul.cpp), and
RMSNorm and in-place rotary embedding (csrc/norm_rope.cpp), whose torch forms are several small ops each, and a
greedy step's per-row argmax + log-sum-exp in one kernel (csrc/row_stats.cpp), and causal prefill attention over
the pool for bf16 on AVX-512 (csrc/prefill_attention.cpp; SDPA stays the path elsewhere), and the decode GEMV over
weights held narrower than the compute dtype, int8 or bf16 (csrc/weight_gemv.cpp; engine/quant.py), and a step's
new K/V rows stored into the pool in one call (csrc/kv_write.cpp), and every decoder layer of a small all-decode
step as one call over those kernels (csrc/decoder_stack.cpp; engine/decoder_stack.py), and a sparse MoE layer's
routed experts for a decode-sized batch in one call (csrc/moe_experts.cpp; engine/moe.py), and the weighted sum
that closes a many-token step's grouped experts (csrc/moe_combine.cpp; engine/moe_grouped.py).
Every kernel has a pure-torch twin in attention.py that the tests
compare it against; when the build is impossible (no compiler, `PDSERVE_NATIVE_KERNELS=0`, a non-CPU device) the
engine uses the twin and says so once in its log.

A start never waits on the build without bound (docs/engine.md, "Building the kernels"):
- the cache directory is keyed by everything the binary depends on (source digest, torch version and install,
  Python, compiler, flags, the CPU `-march=native` targets), so checkouts and venvs never rebuild each other's;
- the build runs in a child process under a builder lock (flock: released by the kernel when its holder dies) and
  is abandoned after PDSERVE_KERNEL_BUILD_TIMEOUT seconds (the torch path is used; the next start tries again);
- torch's own build lock (a `lock` file it creates and deletes, recording no owner) left by an interrupted build
  is removed by the next builder, which holds the builder lock and so knows no one else is building;
- a finished build is marked READY and later starts import the .so directly, taking no lock at all.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve import env_knobs

log = logging.getLogger(__name__)
_lock = threading.Lock()
_module = None
_failed: str | None = None

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("bindings.cpp", "paged_attention.cpp", "silu_and_mul.cpp", "norm_rope.cpp", "row_stats.cpp",
           "prefill_attention.cpp", "weight_gemv.cpp", "kv_write.cpp", "decoder_stack.cpp", "moe_experts.cpp",
           "moe_combine.cpp")
# -march=native: the extension is built on the machine that runs it (the CPU's targets are part of the cache key).
# Reassociation lets g++ vectorise the fp32 dot products and sums (no NaN/inf assumptions).
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
# PDSERVE_CPU_ISA (cpu_isa.py) lowers -march=native's target, so an AVX-512 machine can build and test the AVX2
# (or plain C++) paths; each -mno- also drops every extension that depends on it (GCC's ISA dependency graph).
ISA_CAP_FLAGS = {
    "scalar": ("-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-amx-tile"),
    "avx2": ("-mno-avx512f", "-mno-amx-tile"),
    "avx512": ("-mno-avx512bf16", "-mno-amx-tile"),
    "avx512_bf16": ("-mno-amx-tile",),
    "amx": (),
}
DEFAULT_BUILD_TIMEOUT_S = 300.0  # a cold build: ~100 s on 2 busy cores (docs/engine.md); Kubernetes allows 900 s
READY = "READY"
BUILDER_LOCK = ".pdserve-build.lock"
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory


def _cpu_targets() -> str:
    """What -march=native compiles for: the CPU model and its feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform
        return platform.machine() + platform.processor()
    wanted = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(wanted))  # first core's lines (the rest repeat them)


def cflags() -> tuple[str, ...]:
    """CFLAGS plus the ISA cap's flags when PDSERVE_CPU_ISA is set (part of the cache key: its own build)."""
    from pdserve.engine.cpu_isa import ISA_ENV, cpu_vendor, detected_level
    vendor = ("-DPDSERVE_CPU_AMD",) if cpu_vendor() == "AuthenticAMD" else ()  # weight_gemv.cpp's batch-1 shape
    return CFLAGS + vendor + (ISA_CAP_FLAGS[detected_level()] if env_knobs.get(ISA_ENV).strip() else ())


def compiler() -> str:
    return os.environ.get("CXX", "c++")  # what torch's builder runs


def _torch_install() -> tuple[str, str]:
    """torch's version and install directory, read without importing torch (~1 s), so that `pdserve up` can see
    that the kernels are built without loading it. A torch without package metadata (a source tree) is imported."""
    import importlib.metadata
    try:
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.origin:
            return importlib.metadata.version("torch"), os.path.dirname(spec.origin)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        pass
    import torch
    return torch.__version__, os.path.dirname(torch.__file__)


def cache_key() -> str:
    h = hashlib.sha256()
    for f in sorted(CSRC.iterdir()):
        if f.suffix in (".cpp", ".h"):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for part in (*_torch_install(), sys.version, compiler(), " ".join(cflags()),
                 " ".join(LDFLAGS), _cpu_targets()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def module_name(key: str) -> str:
    return f"pdserve_cpu_kernels_{key}"  # the .so's PyInit_ name: unique per key, so two builds never collide


def cache_dir(key: str | None = None) -> Path:
    """<TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions>/pdserve_cpu_kernels_<key>."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                    "torch_extensions")
    return Path(root) / module_name(key or cache_key())


def build_timeout_s() -> float:
    raw = env_knobs.get("PDSERVE_KERNEL_BUILD_TIMEOUT")
    try:
        return float(raw) if raw else DEFAULT_BUILD_TIMEOUT_S
    except ValueError:
        raise ValueError(f"PDSERVE_KERNEL_BUILD_TIMEOUT={raw!r} is not a number of seconds") from None


def _import(d: Path, name: str):
    import torch  # noqa: F401 - the .so links libtorch / libc10, found only once torch has loaded them
    spec = importlib.util.spec_from_file_location(name, d / f"{name}.so")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(d: Path) -> None:
    """Build into `d` (in the child process; blocking). Idempotent: returns at once when `d` is READY."""
    import fcntl
    d.mkdir(parents=True, exist_ok=True)
    name = d.name
    with open(d / BUILDER_LOCK, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel however this process ends
        held.truncate(0)
        held.write(f"{os.getpid()}\n")
        held.flush()
        if (d / READY).exists():
            return  # another builder finished while we waited
        stale = d / TORCH_LOCK
        if stale.exists():  # every builder holds the builder lock first, and we hold it: its owner is gone
            log.warning("removing the stale kernel build lock %s (left by an interrupted build)", stale)
            stale.unlink()
        mod = None
        if (d / f"{name}.so").exists():  # an interrupted build may have linked already: keep it if it loads
            try:
                mod = _import(d, name)
            except (ImportError, OSError):
                (d / f"{name}.so").unlink()
        if mod is None:
            from torch.utils.cpp_extension import load
            try:  # torch runs `ninja` from PATH; the pip package's binary sits in an unactivated venv's bin
                import ninja
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                pass
            # Sources copied into the keyed directory: build.ninja then names the same paths for every checkout
            # with these sources, so ninja's command-line check never forces a rebuild between them.
            src = d / "src"
            src.mkdir(exist_ok=True)
            for f in CSRC.iterdir():
                if f.suffix in (".cpp", ".h"):
                    shutil.copy2(f, src / f.name)
            load(name=name, sources=[str(src / f) for f in SOURCES], build_directory=str(d),
                 extra_cflags=list(cflags()), extra_ldflags=list(LDFLAGS), verbose=False)
        tmp = d / (READY + ".tmp")
        tmp.write_text(json.dumps({"built_by": os.getpid(), "at": time.time()}))
        os.replace(tmp, d / READY)


def _stop(child: subprocess.Popen) -> None:
    """End the builder and its compilers. SIGTERM first: ninja runs each compiler in a process group of its own and
    kills them only when it is itself asked to stop (SIGKILL would orphan them); SIGKILL after 5 s."""
    try:
        os.killpg(child.pid, signal.SIGTERM)
        child.wait(5)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def _build_in_child(d: Path, timeout_s: float) -> str | None:
    """Run build(d) in a child process group; None on success, else why not (the child is killed on timeout)."""
    d.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[2])  # this checkout's pdserve, whatever the child's sys.path
    code = (f"import sys, logging; sys.path.insert(0, {root!r}); logging.basicConfig(level=logging.INFO); "
            f"from pathlib import Path; from pdserve.engine.kernels import build; build(Path({str(d)!r}))")
    with open(d / "build.log", "w") as out:
        child = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _stop(child)
            return (f"the build did not finish within {timeout_s:g} s (PDSERVE_KERNEL_BUILD_TIMEOUT); build them "
                    f"ahead with `python -m pdserve.engine.kernels`")
        finally:
            if child.poll() is None:  # interrupted while waiting (KeyboardInterrupt): never leave it running
                _stop(child)
    if rc != 0:
        lines = [ln.strip() for ln in (d / "build.log").read_text(errors="replace").splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        return f"build failed (exit {rc}): {last[:300]} (full log: {d / 'build.log'})"
    return None


def native_ops():
    """The compiled module, or None when it cannot be built here (the reason is logged once)."""
    global _module, _failed
    if _module is not None or _failed is not None:
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        if not env_knobs.enabled("PDSERVE_NATIVE_KERNELS"):
            _failed = "disabled by PDSERVE_NATIVE_KERNELS=0"
            return None
        try:
            key = cache_key()
            d = cache_dir(key)
            if not (d / READY).exists():
                cxx = compiler()
                if shutil.which(cxx) is None:  # say so in one line rather than after a failed build
                    raise RuntimeError(f"no C++ compiler: {cxx!r} not found (CXX / PATH)")
                timeout_s = build_timeout_s()
                log.warning("compiling native kernels (one-time, cached in %s; the torch path if not done in %g s)...",
                            d, timeout_s)
                t0 = time.monotonic()
                why = _build_in_child(d, timeout_s)
                if why:
                    raise RuntimeError(why)
                log.info("native kernels compiled in %.0f s", time.monotonic() - t0)
            _module = _import(d, module_name(key))
        except Exception as e:  # no compiler / ninja / headers, a timeout: fall back, loudly
            _failed = f"{type(e).__name__}: {e}"
            log.warning("native kernels unavailable, using the torch path: %s", _failed[:500])
        return _module


def native_ready() -> bool:
    """Whether this process would import built kernels without building (and without importing torch to tell)."""
    if not env_knobs.enabled("PDSERVE_NATIVE_KERNELS"):
        return False
    return (cache_dir() / READY).exists()


def native_unavailable_reason() -> str | None:
    native_ops()
    return _failed


if __name__ == "__main__":  # `python -m pdserve.engine.kernels`: build ahead (an image build, a node warm-up)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("PDSERVE_KERNEL_BUILD_TIMEOUT", "86400")
    ok = native_ops() is not None
    print(f"native kernels: {'ready in ' + str(cache_dir()) if ok else 'unavailable: ' + str(_failed)}")
    sys.exit(0 if ok else 1)
