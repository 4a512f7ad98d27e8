"""Building the native kernels never hangs a start: a stale torch build lock left by an interrupted build
is removed and the kernels load; a build past PDSERVE_KERNEL_BUILD_TIMEOUT is killed (with its compilers) and the
torch path is used; with no compiler the engine runs on the torch path after one log line; the cache key follows
sources, torch, compiler and flags, not the checkout's path. Every start here is a fresh process with its own
TORCH_EXTENSIONS_DIR (never the shared cache)."""
from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.engine import kernels

ROOT = Path(__file__).resolve().parents[2]


def _start(ext_dir: Path, code: str, timeout: float, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """A fresh process (as a worker's start) running `code` after `native_ops()`; (result, seconds)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "TORCH_EXTENSIONS_DIR", "CXX"))}
    full.update(PYTHONPATH=str(ROOT), TORCH_EXTENSIONS_DIR=str(ext_dir), **env)
    script = ("import logging; logging.basicConfig(level=logging.WARNING, format='LOG %(message)s')\n"
              "from pdserve.engine.kernels import native_ops, native_unavailable_reason\n" + code)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], env=full, capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0


def _log_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.startswith("LOG ")]


def test_cache_key_follows_sources_torch_compiler_flags_not_the_checkout(tmp_path, monkeypatch):
    base = kernels.cache_key()
    copy = tmp_path / "other-checkout" / "csrc"
    shutil.copytree(kernels.CSRC, copy)
    monkeypatch.setattr(kernels, "CSRC", copy)
    assert kernels.cache_key() == base  # same sources elsewhere: the same kernels, no rebuild
    (copy / "simd.h").write_text((copy / "simd.h").read_text() + "\n// changed\n")
    edited = kernels.cache_key()
    assert edited != base  # a header counts too
    monkeypatch.setattr(kernels, "CFLAGS", kernels.CFLAGS + ("-DX",))
    assert kernels.cache_key() not in (base, edited)
    monkeypatch.setattr(kernels, "CFLAGS", kernels.CFLAGS[:-1])
    monkeypatch.setenv("CXX", "clang++")
    assert kernels.cache_key() not in (base, edited)
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.0.0" if d == "torch" else real_version(d))
    monkeypatch.delenv("CXX")
    assert kernels.cache_key() not in (base, edited)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert kernels.cache_dir("abc") == tmp_path / "pdserve_cpu_kernels_abc"


def test_isa_cap_builds_under_its_own_key(monkeypatch):
    """PDSERVE_CPU_ISA lowers the compile target (kernels.ISA_CAP_FLAGS) and so gets a cache key of its own."""
    from pdserve.engine import cpu_isa
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    cpu_isa.detected_level.cache_clear()
    base, flags = kernels.cache_key(), kernels.cflags()
    try:
        monkeypatch.setenv(cpu_isa.ISA_ENV, "scalar")
        cpu_isa.detected_level.cache_clear()
        assert kernels.cflags() == flags + kernels.ISA_CAP_FLAGS["scalar"]
        assert kernels.cache_key() != base
    finally:
        monkeypatch.delenv(cpu_isa.ISA_ENV)
        cpu_isa.detected_level.cache_clear()
    assert kernels.cache_key() == base


@pytest.fixture(scope="module")
def built_dir() -> Path:
    """The kernels this session built (tests/conftest.py builds them once) - copied from, never changed."""
    if kernels.native_ops() is None:
        pytest.skip(f"native kernels unavailable here: {kernels.native_unavailable_reason()}")
    return kernels.cache_dir()


def test_stale_torch_lock_is_removed_and_the_kernels_load(built_dir, tmp_path):
    """What an interrupted build leaves: torch's `lock` file (it records no owner, and torch waits on it forever)
    and no READY mark. The next start takes the builder lock (free: its owner is gone), removes the stale lock and
    loads the kernels (the interrupted build had linked them; a build that had not gets compiled again)."""
    d = tmp_path / built_dir.name
    shutil.copytree(built_dir, d, ignore=shutil.ignore_patterns(kernels.READY, kernels.BUILDER_LOCK, "build.log"))
    (d / kernels.TORCH_LOCK).touch()
    r, took = _start(tmp_path, "m = native_ops(); assert m is not None, native_unavailable_reason()\n"
                               "print('ok', hasattr(m, 'silu_and_mul'))", timeout=120,
                     PDSERVE_KERNEL_BUILD_TIMEOUT="90")
    assert r.returncode == 0 and "ok True" in r.stdout, r.stderr[-3000:]
    assert not (d / kernels.TORCH_LOCK).exists() and (d / kernels.READY).exists()
    assert "removing the stale kernel build lock" in (d / "build.log").read_text()
    assert took < 90
    # READY now: the next start imports directly (no builder, no compile line)
    r, _ = _start(tmp_path, "assert native_ops() is not None", timeout=60)
    assert r.returncode == 0 and _log_lines(r) == [], r.stderr[-2000:]


def _processes_mentioning(text: str) -> list[str]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                out.append(f"{p.name}: {cmd[:200]}")
    return out


def test_build_past_the_timeout_is_killed_and_the_torch_path_used(tmp_path):
    r, took = _start(tmp_path, "print('module', native_ops()); print('why', native_unavailable_reason())",
                     timeout=120, PDSERVE_KERNEL_BUILD_TIMEOUT="3")
    assert r.returncode == 0 and "module None" in r.stdout, r.stderr[-3000:]
    assert "did not finish within 3 s" in r.stdout
    lines = _log_lines(r)
    assert len(lines) == 2 and lines[0].startswith("LOG compiling native kernels (one-time"), lines
    assert "using the torch path" in lines[1] and "python -m pdserve.engine.kernels" in lines[1]
    assert took < 60
    # the builder and its compilers are gone, and so is their hold on the builder lock
    [d] = tmp_path.glob("pdserve_cpu_kernels_*")
    assert _processes_mentioning(str(tmp_path)) == []
    with open(d / kernels.BUILDER_LOCK) as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert not (d / kernels.READY).exists()


@pytest.mark.parametrize("how", ["CXX", "PATH"])
def test_no_compiler_engine_runs_the_torch_path_after_one_line(how, tiny_llama, tmp_path):
    env = {"CXX": "/nonexistent/g++"} if how == "CXX" else {"PATH": str(tmp_path / "empty-bin")}
    code = ("from pdserve.engine.engine import Engine, EngineConfig\n"
            "from pdserve.engine.sampling_params import SamplingParams\n"
            f"e = Engine.from_pretrained({str(tiny_llama)!r}, EngineConfig(num_gpu_blocks=32))\n"
            "o = e.generate(['the quick brown fox'], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))\n"
            "print('tokens', len(o[0].outputs[0].token_ids), 'native', e.runner.native_ops is not None)\n")
    r, took = _start(tmp_path, code, timeout=120, **env)
    assert r.returncode == 0 and "tokens 4 native False" in r.stdout, r.stderr[-3000:]
    lines = _log_lines(r)
    assert len(lines) == 1 and "using the torch path" in lines[0] and "no C++ compiler" in lines[0], lines
    assert not list(tmp_path.glob("pdserve_cpu_kernels_*"))  # nothing attempted, nothing left behind


def test_failing_compiler_falls_back_naming_the_log(tmp_path):
    r, _ = _start(tmp_path, "print('module', native_ops())", timeout=120, CXX=shutil.which("false") or "/bin/false")
    assert r.returncode == 0 and "module None" in r.stdout, r.stderr[-3000:]
    lines = _log_lines(r)
    assert len(lines) == 2 and "build failed" in lines[1] and "build.log" in lines[1], lines


def test_native_ready_reads_the_cache_without_importing_torch(tmp_path):
    """`pdserve up` asks native_ready() before deciding to spend a child process (and a torch import) on a
    build; the answer must come from the cache directory alone and agree with what a build leaves there."""
    script = ("import sys, os; from pdserve.engine import kernels as k; r = k.native_ready(); "
              "print(r, 'torch' in sys.modules, k.cache_dir())")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    ready, torch_loaded, d = out.stdout.split()
    assert (ready, torch_loaded) == ("False", "False")
    assert Path(d) == tmp_path / kernels.module_name(kernels.cache_key())  # the key this process (torch loaded) computes
    Path(d).mkdir(parents=True)
    (Path(d) / kernels.READY).touch()
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[:2] == ["True", "False"]
    env["PDSERVE_NATIVE_KERNELS"] = "0"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[0] == "False"
