"""No function on a request path is longer than 60 lines: a request is followed from the gateway through the
router, the prefill and decode sides and the worker to the engine's step, and a function longer than a screen is
where a newcomer gets lost. Read statically with `ast` (a nested function counts on its own and inside its parent,
decorators and docstring included).

Off the request path and longer, on purpose or not yet split: start-up and CLI code (`services/up.py:up`,
`cli_flags.py`, `engine/tp/rank.py:main`), checkpoint loading (`engine/config.py:ModelConfig.from_dir`), Triton
kernels (one `@triton.jit` function is one kernel), the bench, the simulator and the built-in model's trainer.
"""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "pdserve"
LIMIT = 60

# What a request runs through, from the HTTP or gRPC front door to the engine's step and back.
REQUEST_PATH = [
    "services/gateway", "services/router", "services/prefill", "services/decode", "services/worker.py",
    "kv_transfer",
    "engine/engine.py", "engine/engine_admit.py", "engine/engine_step.py", "engine/engine_reclaim.py",
    "engine/engine_disagg.py", "engine/engine_load.py", "engine/async_engine.py", "engine/core.py",
    "engine/scheduler.py", "engine/sched_policy.py", "engine/block_manager.py", "engine/model_runner.py",
    "engine/attention.py", "engine/sampler.py", "engine/sampling_state.py",
]


def long_functions(paths: list[Path], limit: int = LIMIT) -> list[tuple[int, str]]:
    """(lines, "file:line name") of every function in `paths` longer than `limit` lines."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                n = node.end_lineno - first + 1
                if n > limit:
                    where = path.relative_to(PKG.parent) if path.is_relative_to(PKG.parent) else path.name
                    out.append((n, f"{where}:{node.lineno} {node.name}"))
    return sorted(out, reverse=True)


def _files(entry: str) -> list[Path]:
    p = PKG / entry
    assert p.exists(), f"{entry} named in REQUEST_PATH does not exist (moved? update the list)"
    return sorted(p.rglob("*.py")) if p.is_dir() else [p]


def test_no_request_path_function_is_longer_than_a_screen():
    found = long_functions([f for entry in REQUEST_PATH for f in _files(entry)])
    assert not found, "split these (one step per function):\n" + "\n".join(f"  {n} lines  {w}" for n, w in found)


def test_the_check_counts_decorators_and_nested_functions(tmp_path):
    probe = tmp_path / "probe.py"  # f: a decorator + 123 lines; g, inside it: 62 lines; h: exactly 60
    probe.write_text("@dec\ndef f():\n" + "    x = 1\n" * 60 + "    def g():\n" + "        y = 2\n" * 61
                     + "def h():\n" + "    z = 3\n" * 59)
    assert [w.split()[-1] for _, w in long_functions([probe])] == ["f", "g"]
