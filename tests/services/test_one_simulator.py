"""There is one simulator, `pdserve.sim`: the router-level one that lived in `pdserve/services/router/sim.py`
is gone, nothing imports it, and no service module depends on the simulator."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def _py_files(*dirs: str) -> list[Path]:
    return [p for d in dirs for p in (ROOT / d).rglob("*.py") if "_proto" not in p.parts]


def test_router_simulator_is_gone():
    assert not (ROOT / "pdserve/services/router/sim.py").exists()
    assert importlib.util.find_spec("pdserve.services.router.sim") is None


def test_nothing_imports_a_services_simulator_and_services_do_not_import_the_simulator():
    files = _py_files("pdserve", "tests", "bench")
    assert len(files) > 100  # the walk sees the tree
    bad = [str(p.relative_to(ROOT)) for p in files
           if any(n == "pdserve.services.router.sim" or n.startswith("pdserve.services.router.sim.")
                  for n in _imports(p))]
    assert not bad, bad
    services = _py_files("pdserve/services")
    uses_sim = [str(p.relative_to(ROOT)) for p in services
                if any(n == "pdserve.sim" or n.startswith("pdserve.sim.") for n in _imports(p))]
    assert not uses_sim, uses_sim
