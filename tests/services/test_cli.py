"""The command line fails fast and speaks plainly.

`pdserve up` runs as the real `python -m pdserve up` subprocess: a bad model path, a hub id, a busy port, a missing
redis-server each end within 3 s, exit non-zero, and print one line naming the problem and the fix. Environment
variables are parsed and checked like their flags, `--help` works with a bad one and lists defaults and names,
typos get the closest flag or command, and errors are one line unless -v asks for the traceback.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.cli import DTYPES, MODES, POLICIES, PREEMPTION_MODES, build_parser
from pdserve.cli_args import env_name
from pdserve.services.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def pdserve(*argv: str, env: dict | None = None, cwd: Path | None = None) -> tuple[int, str, str, float]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    full["PYTHONPATH"] = str(ROOT)
    full.update(env or {})
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pdserve", *argv], env=full, cwd=cwd, capture_output=True, text=True,
                       timeout=30)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# ---- pdserve up: checks before anything starts ------------------------------------------------------------------

def test_up_bad_model_path_one_line_within_3s(tmp_path):
    rc, out, err, took = pdserve("up", "--model", str(tmp_path / "nope"), "--port", str(free_port()))
    line = one_line(err)
    assert rc == 2 and took < 3.0, (rc, took)
    assert line.startswith("pdserve up: --model ") and str(tmp_path / "nope") in line and "no such directory" in line
    assert "pass a checkpoint directory" in line and out == ""  # nothing was started, nothing to stop


def test_up_not_a_checkpoint_names_the_missing_file(tmp_path):
    rc, _, err, took = pdserve("up", "--model", str(tmp_path), "--port", str(free_port()))
    assert rc == 2 and took < 3.0 and "no config.json" in one_line(err)


def test_up_hub_id_gets_the_no_hub_hint(tmp_path):
    rc, _, err, took = pdserve("up", "--model", "meta-llama/Llama-3.1-8B", "--port", str(free_port()), cwd=tmp_path)
    line = one_line(err)
    assert rc == 2 and took < 3.0
    assert "Hugging Face hub id" in line and "no hub access" in line
    assert "huggingface-cli download meta-llama/Llama-3.1-8B --local-dir ./Llama-3.1-8B" in line
    assert line.endswith("--model ./Llama-3.1-8B")


def test_up_busy_port_is_named_with_its_owner():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err, took = pdserve("up", "--port", str(port))
    line = one_line(err)
    assert rc == 2 and took < 3.0
    assert f"--port {port}: port {port} on 127.0.0.1 is already in use by pid {os.getpid()}" in line
    suggested = int(re.search(r"e\.g\. --port (\d+)", line).group(1))
    assert suggested != port


def test_up_busy_grpc_port_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, _, err, _ = pdserve("up", "--port", str(free_port()), "--grpc-port", str(port))
    assert rc == 2 and f"--grpc-port {port}: port {port}" in one_line(err)


def test_up_without_redis_server_on_path(tmp_path):
    rc, _, err, took = pdserve("up", "--port", str(free_port()), env={"PATH": str(tmp_path)})
    line = one_line(err)
    assert rc == 2 and took < 3.0 and "redis-server not found on PATH" in line and "--redis-url" in line


def test_up_unreachable_redis_url():
    port = free_port()
    rc, _, err, took = pdserve("up", "--port", str(free_port()), "--redis-url", f"redis://127.0.0.1:{port}/0")
    assert rc == 2 and took < 3.0 and f"nothing answers at 127.0.0.1:{port}" in one_line(err)


def test_up_without_workers():
    rc, _, err, _ = pdserve("up", "--mode", "colocated", "--workers", "0", "--port", str(free_port()))
    assert rc == 2 and "no workers to start (--workers is 0)" in one_line(err)


def test_gateway_and_worker_check_the_model_too(tmp_path):
    for cmd in ("gateway", "worker"):
        rc, _, err, took = pdserve(cmd, "--model", str(tmp_path / "nope"))
        assert rc == 2 and took < 3.0 and one_line(err).startswith(f"pdserve {cmd}: --model {tmp_path / 'nope'}")


# ---- environment variables --------------------------------------------------------------------------------------

def test_bad_env_value_is_one_line_naming_the_variable_and_help_still_works():
    rc, _, err, _ = pdserve("up", env={"PDSERVE_THREADS": "two"})
    assert rc == 2 and one_line(err).startswith("pdserve up: error: PDSERVE_THREADS='two' (for --threads): ")
    for argv in (["--help"], ["up", "--help"]):
        rc, out, err, _ = pdserve(*argv, env={"PDSERVE_THREADS": "two"})
        assert rc == 0 and err == "" and "usage: pdserve" in out
    rc, out, _, _ = pdserve("up", "--help", env={"PDSERVE_THREADS": "two"})
    assert "PDSERVE_THREADS='two'" in re.sub(r"\s+", " ", out)  # --help shows what the variable holds


def parse(argv, monkeypatch, env=None):
    for k in [k for k in os.environ if k.startswith("PDSERVE_")]:
        monkeypatch.delenv(k)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return build_parser().parse_args(argv)


def parse_error(argv, monkeypatch, capsys, env=None) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv, monkeypatch, env)
    assert e.value.code == 2
    return one_line(capsys.readouterr().err)


@pytest.mark.parametrize("var,value,want", [
    ("PDSERVE_MODE", "fast", "PDSERVE_MODE='fast' (for --mode): choose from auto, disagg, colocated"),
    ("PDSERVE_PORT", "tcp://10.0.0.1:8000", "PDSERVE_PORT='tcp://10.0.0.1:8000' (for --port): "),
    ("PDSERVE_PORT", "70000", "'70000' must be <= 65535"),
    ("PDSERVE_KV_OVERCOMMIT", "0", "PDSERVE_KV_OVERCOMMIT='0' (for --kv-overcommit): '0' must be > 0"),
    ("PDSERVE_POLICY", "lifo", "PDSERVE_POLICY='lifo' (for --policy): choose from fcfs,"),
])
def test_env_values_are_validated_like_flags(monkeypatch, capsys, var, value, want):
    assert want in parse_error(["up"], monkeypatch, capsys, {var: value})
    flag = "--" + var.removeprefix("PDSERVE_").lower().replace("_", "-")
    assert "argument " + flag in parse_error(["up", flag, value], monkeypatch, capsys)  # the flag: same verdict


def test_env_values_parse_to_the_flags_type_and_flags_win(monkeypatch):
    a = parse(["up"], monkeypatch, {"PDSERVE_PORT": "9001", "PDSERVE_KV_OVERCOMMIT": "1.5", "PDSERVE_MODE": "disagg",
                                    "PDSERVE_REDIS_URL": "redis://r:6379/0"})
    assert (a.port, a.kv_overcommit, a.mode, a.redis_url) == (9001, 1.5, "disagg", "redis://r:6379/0")
    assert parse(["up", "--port", "9002"], monkeypatch, {"PDSERVE_PORT": "9001"}).port == 9002
    assert parse(["up"], monkeypatch).port == 8000  # no variable: the default
    # a variable for a flag the command does not have is not its business
    assert parse(["router"], monkeypatch, {"PDSERVE_THREADS": "two"}).port == 7000


def test_help_lists_defaults_and_env_names(monkeypatch, capsys):
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices
    for cmd in ("up", "gateway", "router", "worker"):
        with pytest.raises(SystemExit):
            parse([cmd, "--help"], monkeypatch)
        text = re.sub(r"\s+", " ", capsys.readouterr().out)
        for action in sub[cmd]._actions:
            if action.option_strings and action.dest not in ("help", "verbose"):
                assert env_name(action.dest) in text, (cmd, action.dest)
                if action.default is not None:
                    assert f"default: {action.default}" in text, (cmd, action.dest)
    with pytest.raises(SystemExit):
        parse(["up", "--help"], monkeypatch)
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "gateway HTTP port (default: 8000; env PDSERVE_PORT)" in text


def test_engine_names_match_the_engine():
    from pdserve.engine.config import DTYPES as ENGINE_DTYPES
    from pdserve.engine.config import POLICIES as ENGINE_POLICIES
    from pdserve.engine.config import PREEMPTION_MODES as ENGINE_PREEMPTION_MODES
    assert PREEMPTION_MODES == ENGINE_PREEMPTION_MODES
    assert POLICIES == ENGINE_POLICIES and set(DTYPES) == {"auto", *ENGINE_DTYPES} and "auto" in MODES


# ---- typos and one-line errors ----------------------------------------------------------------------------------

def test_typos_get_the_closest_flag_or_command(monkeypatch, capsys):
    line = parse_error(["up", "--redis-ulr", "redis://x"], monkeypatch, capsys)
    assert line.startswith("pdserve up: error: unrecognized arguments: --redis-ulr") and "did you mean --redis-url?" in line
    assert "did you mean --heartbeat-ttl?" in parse_error(["worker", "--hearbeat-ttl=3"], monkeypatch, capsys)
    assert "did you mean 'up'?" in parse_error(["upp"], monkeypatch, capsys)
    assert "did you mean 'disagg'?" in parse_error(["up", "--mode", "disag"], monkeypatch, capsys)
    line = parse_error(["bench", "run", "--concurency", "4"], monkeypatch, capsys)  # parsers of other modules too
    assert line.startswith("pdserve bench run: error:") and "did you mean --concurrency?" in line
    assert "did you mean" not in parse_error(["up", "--zzzz"], monkeypatch, capsys)  # nothing close: no guess


def test_runtime_errors_are_one_line_and_v_adds_the_traceback():
    argv = ["bench", "run", "--extra-body", "{bad", "--base-url", "http://127.0.0.1:1"]
    rc, _, err, _ = pdserve(*argv)
    line = one_line(err)
    assert rc == 1 and line.startswith("pdserve bench: error: ") and line.endswith("(run with -v for the traceback)")
    for verbose in (["-v", *argv], [*argv[:2], "--verbose", *argv[2:]]):
        rc, _, err, _ = pdserve(*verbose)
        assert rc == 1 and err.startswith("Traceback") and err.strip().splitlines()[-1].startswith("pdserve bench: error:")


def test_engine_flags_are_one_table_up_forwards_and_the_worker_reads():
    """cli_flags.ENGINE_FLAGS is what `add_engine` declares; `up` forwards each one given (a 0 too: the truthiness
    test it had dropped `--swap-space 0`), and the worker's EngineConfig gets each under its field name."""
    import dataclasses

    from pdserve.cli_flags import ENGINE_FIELD, ENGINE_FLAGS, SPEC_FLAGS, engine_argv, engine_kwargs
    from pdserve.engine.config import EngineConfig
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert {ENGINE_FIELD.get(d, d) for d in ENGINE_FLAGS} <= fields  # every flag lands on a real field
    up = build_parser().parse_args(["up", "--swap-space", "0", "--kv-offload-bytes", "0", "--num-gpu-blocks", "64",
                                    "--threads", "3", "--speculative", "ngram", "--tensor-parallel-size", "2"])
    argv = engine_argv(up, skip=("tensor_parallel_size",))
    assert argv[argv.index("--swap-space") + 1] == "0.0" and argv[argv.index("--kv-offload-bytes") + 1] == "0"
    assert "--tensor-parallel-size" not in argv  # per role, by up itself
    wk = build_parser().parse_args(["worker", *argv])
    kw = engine_kwargs(wk)
    assert kw == {"swap_space": 0.0, "kv_offload_bytes": 0, "num_gpu_blocks": 64, "num_threads": 3}
    assert not set(SPEC_FLAGS) & set(kw) and wk.speculative == "ngram"  # spec_config's own
    # a switch is forwarded as itself, no value after it (`--deterministic True` would not parse)
    up = build_parser().parse_args(["up", "--deterministic", "--block-size", "8"])
    argv = engine_argv(up)
    assert argv == ["--block-size", "8", "--deterministic"] or argv == ["--deterministic", "--block-size", "8"]
    assert engine_kwargs(build_parser().parse_args(["worker", *argv])) == {"block_size": 8, "deterministic": True}
    assert "deterministic" not in engine_kwargs(build_parser().parse_args(["worker"]))


def test_up_help_shows_every_flag_in_a_named_group():
    """`up` has ~75 flags: each sits in a group (deployment, engine, admission, ...), none loose under "options"."""
    up = build_parser()._subparsers._group_actions[0].choices["up"]
    loose = [a.option_strings[-1] for a in up._optionals._group_actions if a.dest not in ("help", "verbose")]
    assert loose == []
    groups = {g.title: [a.dest for a in g._group_actions] for g in up._action_groups}
    assert "max_num_seqs" in groups["engine (every worker)"] and "mode" in groups["deployment"]
    assert "planner" in groups["planner (docs/planner.md)"]
    text = up.format_help()
    assert text.index("deployment:") < text.index("engine (every worker):") < text.index("planner (docs/planner.md):")
