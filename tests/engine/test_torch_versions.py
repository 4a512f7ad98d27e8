"""The torch range (issue 16 item 6): the package admits torch 2.11-2.14 (GPU hosts commonly have CUDA builds of
2.11), CI installs the CPU build of 2.13 inside that range, and the running torch is one the range admits."""
from __future__ import annotations

import tomllib
from pathlib import Path

import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def torch_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(Requirement(d) for d in deps if Requirement(d).name == "torch")


def test_range_is_2_11_through_2_14():
    spec = torch_requirement().specifier
    for v in ("2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.0", "2.14.1"):
        assert spec.contains(Version(v), prereleases=False), v
    for v in ("2.10.0", "2.15.0"):
        assert not spec.contains(Version(v)), v


def test_ci_installs_a_build_inside_the_range():
    install = (ROOT / "scripts" / "install.sh").read_text()
    pin = next(w.split("==", 1)[1] for w in install.split() if w.startswith("torch=="))
    assert torch_requirement().specifier.contains(Version(pin))


def test_running_torch_is_admitted():
    assert torch_requirement().specifier.contains(Version(torch.__version__))
