"""The torch range: the package admits torch 2.11-2.14 (GPU hosts commonly have CUDA builds of
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


def _torch_names() -> dict[str, set[str]]:
    """Every dotted torch name the package spells (`torch.cuda.graph_pool_handle`, `F.rms_norm` through its
    import alias, `from torch.utils.cpp_extension import load`), with the files that use it."""
    import ast
    names: dict[str, set[str]] = {}
    for path in sorted((ROOT / "pdserve").rglob("*.py")):
        if "_proto" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        alias = {"torch": "torch"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "torch":
                        alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                for a in node.names:
                    alias[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) or (isinstance(node, ast.Name) and node.id in alias):
                parts, cur = [], node
                while isinstance(cur, ast.Attribute):
                    parts.append(cur.attr)
                    cur = cur.value
                if isinstance(cur, ast.Name) and cur.id in alias:
                    full = ".".join([alias[cur.id], *reversed(parts)])
                    names.setdefault(full, set()).add(str(path.relative_to(ROOT)))
    return names


def test_every_torch_name_the_package_uses_exists():
    """Run under each torch of the range (CI: 2.13; by hand: 2.11 and 2.14 builds, see docs/engine.md): a name
    added after 2.11 must be guarded, and would show up here on the older torch."""
    import importlib

    import torch.distributed as dist
    # names only some builds of a release have, used only where they exist (tp/comm.py: NCCL on CUDA)
    build_specific = {"torch.distributed.ProcessGroupNCCL": dist.is_nccl_available()}
    missing = []
    for full, files in sorted(_torch_names().items()):
        if build_specific.get(full) is False:
            continue
        parts = full.split(".")
        obj, i = None, len(parts)
        while i > 0:  # the longest importable module prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                i -= 1
        for attr in parts[i:]:
            if attr.startswith("__") and attr.endswith("__"):
                break
            try:
                obj = getattr(obj, attr)
            except (AttributeError, RuntimeError):
                # a method of a class we do not follow (e.g. torch.Tensor.foo is fine, torch.foo.bar of an
                # instance is not a name): only report a missing module-level name
                if not isinstance(obj, type):
                    missing.append((full, sorted(files)))
                break
    assert not missing, missing
