"""What every line of bench/gpu_check.py shares: the table row, the two ways a check ends early, the run's
device settings (set once by gpu_check.main) and device timing."""
from __future__ import annotations

import functools
import importlib
import time
from dataclasses import dataclass


@dataclass
class Line:
    check: str
    result: str = ""
    target: str = ""
    verdict: str = ""


DEVICE = "cuda"  # --device cpu: a smoke run of this script's own code on a CPU host (its figures mean nothing)
SHAPE = "8b"  # --tiny: the decode lines use a small model (with --device cpu)


class Stopped(BaseException):
    """SIGTERM arrived (the script's hard time limit): not an Exception, so no check swallows it."""


class Skip(Exception):
    """Raised by a check that cannot run here; the message is the reason."""


def importable(*mods: str) -> str | None:
    """None when every module imports, else the first failure."""
    for m in mods:
        try:
            importlib.import_module(m)
        except Exception as e:  # ImportError, or a wheel that imports but cannot load its libraries
            return f"{m} not importable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
    return None


def need_cuda() -> None:
    import torch
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise Skip(f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})")


def sync() -> None:
    import torch
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def empty_cache() -> None:
    import torch
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def gpu_time(fn, reps: int, warmup: int = 3) -> float:
    """Median seconds of fn() with the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def time_calls(obj, name: str, spent: list[float]) -> None:
    """Wrap the method `obj.name` so that the wall time of its calls adds up in spent[0]."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t0
    setattr(obj, name, wrapper)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """HBM traffic per second of a device-to-device copy: (read + written bytes) / s."""
    import torch
    nbytes = nbytes if DEVICE == "cuda" else 256 << 20
    src = torch.ones(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.zeros_like(src)
    copy = functools.partial(dst.copy_, src)
    t = gpu_time(copy, reps=10)
    del src, dst, copy  # freed before empty_cache
    empty_cache()
    return 2 * nbytes / t


ENGINE = ("triton", "pdserve.engine.engine")  # the engine imports xgrammar, tokenizers, safetensors, jinja2, numpy
HF = ("transformers", "safetensors", "tokenizers")
