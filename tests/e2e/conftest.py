"""Real deployments for e2e tests: `pdserve up` as a subprocess (private redis-server, router, workers, gateway),
one per test module; a tiny random Llama checkpoint (tests/conftest.py)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 128


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env["PDSERVE_LOG_LEVEL"] = "WARNING"
    return env


class Up:
    def __init__(self, model: Path, *args: str, timeout: float = 90):
        from pdserve.services.up import free_port
        self.port = free_port()
        cmd = [sys.executable, "-m", "pdserve", "up", "--model", str(model), "--port", str(self.port),
               "--num-gpu-blocks", str(NUM_BLOCKS), *args]
        self.proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.info: dict | None = None
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("PDSERVE_UP "):
                    self.info = json.loads(line[len("PDSERVE_UP "):])
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(timeout) or self.info is None:
            self.stop()
            raise RuntimeError("pdserve up did not become ready:\n" + "".join(self.lines[-50:]))
        self.base_url = self.info["base_url"]

    def workers(self, role: str | None = None) -> list[dict]:
        return [p for p in self.info["processes"] if p.get("role") and (role is None or p["role"] == role)]

    def process(self, name: str) -> dict:
        return next(p for p in self.info["processes"] if p["name"] == name)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def metric(port: int, name: str, labels: str = "") -> float:
    """Read one sample from a Prometheus endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    pat = re.compile(rf"^{re.escape(name)}{re.escape(labels)}\s+(\S+)$", re.M)
    m = pat.search(text)
    return float(m.group(1)) if m else float("nan")


def wait_until(cond, timeout: float = 10.0, interval: float = 0.2) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return cond()


PROMPTS = ["the quick brown fox", "judge my vow", "pack my box with five dozen liquor jugs",
           "seven wizards quietly hex every jolly sphinx of black quartz"]


@pytest.fixture(scope="session")
def offline_greedy(tiny_llama):
    """(token ids, text) the offline engine produces for PROMPTS, greedy, 12 tokens: the reference for both modes."""
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    eng = Engine.from_pretrained(str(tiny_llama), EngineConfig(num_gpu_blocks=NUM_BLOCKS))
    outs = eng.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


SEEDED = dict(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)


@pytest.fixture(scope="session")
def offline_seeded(tiny_llama):
    """Token ids of a seeded sampled (not greedy) request on the offline engine."""
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    eng = Engine.from_pretrained(str(tiny_llama), EngineConfig(num_gpu_blocks=NUM_BLOCKS))
    return eng.generate([PROMPTS[0]], SamplingParams(**SEEDED))[0].outputs[0].token_ids
