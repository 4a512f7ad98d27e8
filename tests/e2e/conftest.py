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



# Shared deployments. Starting `pdserve up` costs 5-8 s of a 2-core box, and several modules start the very same
# configuration, so a configuration that no test mutates (no killed worker, no chaos, no fault knob) is started once
# for all the modules that use it:
#
#     @shared_deployment
#     def colocated_ck(request):            # the fixture's name is the configuration's key
#         return Up(ck_model(request), "--mode", "colocated", "--workers", "1")
#
# and a module uses it as any fixture (`def up(colocated_ck): return colocated_ck`). The modules using one shared
# deployment run next to each other (their tests keep their order inside each module), and the deployment is
# stopped right after the last test that uses it (-k, -m and -x included), asserting a clean exit: `up` exits 0 and
# none of its children is left. A module whose tests mutate the deployment keeps its own module fixture.

_SHARED: dict[str, UpProcess] = {}


def shared_deployment(start):
    """A fixture over the deployment `start(request)` returns, shared by every test that uses the fixture."""
    name = start.__name__

    @pytest.fixture(name=name)
    def fixture(request) -> UpProcess:
        d = _SHARED.get(name)
        if d is None:
            d = _SHARED[name] = start(request)
        assert d.proc.poll() is None, f"shared deployment {name} exited:\n" + "".join(d.lines[-30:])
        return d
    return fixture


def ck_model(request) -> Path:
    """The tiny checkpoint under the directory name `ck` (served model name `ck`)."""
    import shutil
    model = request.getfixturevalue("tiny_llama").parent / "ck"
    if not model.exists():
        shutil.copytree(request.getfixturevalue("tiny_llama"), model)
    return model


@shared_deployment
def colocated_ck(request):
    return Up(ck_model(request), "--mode", "colocated", "--workers", "1")


@shared_deployment
def colocated_builtin(request):
    return UpProcess(["--model", "builtin", "--num-gpu-blocks", "256", "--mode", "colocated", "--workers", "1"],
                     _env(), 120)


def _shared_names(item) -> list[str]:
    return [n for n in item.fixturenames if n in _SHARED_FIXTURES]


_SHARED_FIXTURES = ("colocated_ck", "colocated_builtin")


def pytest_collection_modifyitems(config, items):
    """Modules that use one shared deployment run next to each other, where the first of them was."""
    e2e = Path(__file__).parent
    module_key: dict[Path, str] = {}
    for item in items:
        if item.path.parent == e2e and _shared_names(item):
            module_key.setdefault(item.path, _shared_names(item)[0])
    groups: dict[object, list] = {}
    for item in items:
        groups.setdefault(module_key.get(item.path, item.path), []).append(item)
    items[:] = [it for group in groups.values() for it in group]


def _stop_shared(name: str) -> None:
    d = _SHARED.pop(name)
    assert d.stop() == 0, f"shared deployment {name} did not exit cleanly"
    for proc in d.info["processes"]:  # every child (redis, router, workers, gateway) is gone
        try:
            os.kill(proc["pid"], 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"{proc['name']} still running after pdserve up stopped")


def pytest_runtest_teardown(item, nextitem):
    """Stop a shared deployment after the last test that uses it."""
    items = item.session.items
    later = items[items.index(item) + 1:] if nextitem is not None else []
    for name in [n for n in _shared_names(item) if n in _SHARED]:
        if not any(name in it.fixturenames for it in later):
            _stop_shared(name)


def pytest_sessionfinish(session):
    for name in list(_SHARED):  # a run cut short (-x, Ctrl-C)
        _SHARED.pop(name).stop()
