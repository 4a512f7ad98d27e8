"""Real deployments for e2e tests: `pdserve up` as a subprocess (private redis-server, router, workers, gateway),
one per test module; a tiny random Llama checkpoint (tests/conftest.py)."""
from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.services.up_process import UpProcess

ROOT = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 128


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env["PDSERVE_LOG_LEVEL"] = "WARNING"
    return env


class Up(UpProcess):
    def __init__(self, model: Path, *args: str, timeout: float = 90):
        super().__init__(["--model", str(model), "--num-gpu-blocks", str(NUM_BLOCKS), *args], _env(), timeout)


def samples(text: str, name: str, labels: str = "") -> list[float]:
    """Values of the samples called `name` whose labels include `labels` (`{state="CANCELLED"}`; the constant
    labels a process adds, such as `model`, need not be named)."""
    from prometheus_client.parser import text_string_to_metric_families
    want = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    return [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in want.items())]


def metric(port: int, name: str, labels: str = "") -> float:
    """The sum of the matching samples on a Prometheus endpoint (NaN: none)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        vals = samples(r.read().decode(), name, labels)
    return sum(vals) if vals else float("nan")


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


def served_as_ck(tiny_llama: Path, tmp_path_factory, keys_yaml: str) -> tuple[Path, Path]:
    """The tiny checkpoint under the directory name `ck` (so its served model name is `ck`) and an API keys file
    with `keys_yaml`: what the deployments with tenants start from."""
    import shutil
    model = tiny_llama.parent / "ck"
    if not model.exists():
        shutil.copytree(tiny_llama, model)
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(keys_yaml)
    return model, keys

