"""A decode worker switching to prefill hands its streams on (services/role_switch.py, handoff `migrate`) instead
of finishing them: `pdserve up --mode disagg --prefill 1 --decode 2`, each engine step slowed to 30 ms so that a
stream of 160 tokens runs for seconds. Four streams (greedy and seeded) run while a decode worker holding some of
them switches, first with handoff `drain` (the reference for the drain time: it waits for its streams), back, then
with handoff `migrate`.

Checked against independent references: every stream's text (and token count) equals the offline engine's
uninterrupted run of the same request, in both phases; the `migrate` switch ends the streams it held at once
(counted by the worker and by the gateway as `handoff` migrations), completes in well under the `drain` switch's
time, and the moved streams finish elsewhere after the switch returned; no worker holds a KV block or a pin after.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pdserve.services.up_process import UpProcess
from tests.e2e.conftest import NUM_BLOCKS, PROMPTS, ROOT, metric, wait_until

STEP_DELAY_S = 0.03
MAX_TOKENS = 160
SEEDED = dict(temperature=1.0, top_p=0.9, seed=1234)
GREEDY = dict(temperature=0)


@pytest.fixture(scope="module")
def up(tiny_llama):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "WARNING",
           "PDSERVE_FAULT_STEP_DELAY_S": str(STEP_DELAY_S)}
    d = UpProcess(["--no-restart", "--model", str(tiny_llama), "--num-gpu-blocks", str(NUM_BLOCKS),
                   "--mode", "disagg", "--prefill", "1", "--decode", "2"], env, 120)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def references(tiny_llama) -> dict[tuple[str, str], str]:
    """(prompt, kind) -> the offline engine's text for the request, uninterrupted."""
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    eng = Engine.from_pretrained(str(tiny_llama), EngineConfig(num_gpu_blocks=NUM_BLOCKS))
    out = {}
    for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        outs = eng.generate(PROMPTS, SamplingParams(ignore_eos=True, max_tokens=MAX_TOKENS, **params))
        out.update({(p, kind): o.outputs[0].text for p, o in zip(PROMPTS, outs)})
    return out


class Stream(threading.Thread):
    """One streaming completion, read to its end in its own thread; `events` counts choice events as they come."""

    def __init__(self, up, prompt: str, kind: str):
        super().__init__(daemon=True)
        self.up, self.prompt, self.kind = up, prompt, kind
        self.text, self.events, self.usage, self.error, self.route = "", 0, None, None, {}
        self.ended_at: float | None = None
        self.started = threading.Event()

    def run(self) -> None:
        body = {"model": self.up.info["model"], "prompt": self.prompt, "stream": True, "ignore_eos": True,
                "max_tokens": MAX_TOKENS, "stream_options": {"include_usage": True},
                **(GREEDY if self.kind == "greedy" else SEEDED)}
        try:
            with httpx.Client(timeout=120) as c, c.stream("POST", self.up.base_url + "/v1/completions", json=body,
                                                           headers={"x-pdserve-debug": "route"}) as r:
                if r.status_code != 200:
                    self.error = f"{r.status_code}: {r.read().decode()}"
                    return
                self.route = dict(kv.split("=", 1) for kv in r.headers["x-pdserve-route"].split(";") if "=" in kv)
                self.started.set()
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        self.error = ev["error"]
                        return
                    if ev.get("usage"):
                        self.usage = ev["usage"]
                    for ch in ev.get("choices", []):
                        self.text += ch.get("text") or ""
                        self.events += 1
        finally:
            self.ended_at = time.monotonic()
            self.started.set()


def _switch(up, worker: dict, role: str, handoff: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "pdserve", "worker-role", f"127.0.0.1:{worker['port']}", role, "--json",
                        "--handoff", handoff, "--internal-token-file", up.info["internal_token_file"]],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _run_phase(up, references, handoff: str) -> tuple[dict, dict, list[Stream], float]:
    """Four streams; once each has sent a few events, the decode worker holding the most of them switches to
    prefill with `handoff`. Returns (the switch's answer, the worker, the streams, when the switch returned)."""
    streams = [Stream(up, p, "greedy" if i % 2 == 0 else "seeded") for i, p in enumerate(PROMPTS)]
    for s in streams:
        s.start()
    assert all(s.started.wait(60) for s in streams)
    assert wait_until(lambda: all(s.events >= 4 or s.ended_at for s in streams), 60, 0.02)
    assert not any(s.error for s in streams), [s.error for s in streams]
    decode = {w["worker_id"]: w for w in up.workers("decode")}
    held = {wid: [s for s in streams if s.route.get("decode") == wid] for wid in decode}
    wid = max(held, key=lambda k: len(held[k]))
    assert held[wid], {k: len(v) for k, v in held.items()}
    assert not any(s.ended_at for s in held[wid])  # 160 tokens at >= 30 ms a step: far from their end
    r = _switch(up, decode[wid], "prefill", handoff)
    t_switched = time.monotonic()
    for s in streams:
        s.join(120)
    for s in streams:
        assert s.error is None, (handoff, s.kind, s.error)
        assert s.text == references[(s.prompt, s.kind)], (handoff, s.kind, s.prompt, s.text)
        assert s.usage["completion_tokens"] == MAX_TOKENS, s.usage
    r["held_streams"] = held[wid]
    return r, decode[wid], streams, t_switched


def test_handoff_moves_streams_with_the_same_tokens(up, references):
    # drain: the reference for the drain time (the switch waits for its streams to finish here)
    drained, w1, _, _ = _run_phase(up, references, "drain")
    assert drained["switched"] and drained["handoff"] == "drain" and drained["handed_off"] == 0, drained
    assert drained["drained_requests"] >= len(drained["held_streams"]), drained
    assert _switch(up, w1, "decode", "drain")["switched"]  # two decode workers again
    gw_before = metric(up.port, "pdserve_migrations_total", '{reason="handoff"}')
    gw_before = 0 if gw_before != gw_before else gw_before  # NaN: no sample yet

    # migrate: the streams leave at their next message and finish on the other decode worker
    moved, w2, streams, t_switched = _run_phase(up, references, "migrate")
    n = len(moved["held_streams"])
    print(f"drain switch {drained['seconds']:.2f} s ({len(drained['held_streams'])} streams held), migrate switch "
          f"{moved['seconds']:.2f} s ({n} streams handed off); the moved streams ended "
          f"{min(s.ended_at for s in moved['held_streams']) - t_switched:.2f}-"
          f"{max(s.ended_at for s in moved['held_streams']) - t_switched:.2f} s after it returned")
    assert moved["switched"] and moved["handoff"] == "migrate", moved
    assert moved["handed_off"] == n, moved
    assert moved["seconds"] < drained["seconds"] / 3, (moved, drained)
    # the moved streams did not end on the switching worker: they ran on after it had become a prefill worker
    assert all(s.ended_at > t_switched + 1.0 for s in moved["held_streams"]), \
        [s.ended_at - t_switched for s in moved["held_streams"]]
    assert metric(w2["metrics_port"], "pdserve_role_switch_handoffs_total") == n
    assert metric(up.port, "pdserve_migrations_total", '{reason="handoff"}') == gw_before + n
    # the switched worker serves as prefill, running nothing of its old streams (the gauge follows its heartbeat)
    assert wait_until(lambda: metric(w2["metrics_port"], "pdserve_num_running") == 0, 10)

    # nothing left behind on any worker
    def clean() -> bool:
        return all(metric(p["metrics_port"], "pdserve_kv_blocks_in_use") == 0
                   and metric(p["metrics_port"], "pdserve_kv_blocks_pinned") == 0 for p in up.workers())

    assert wait_until(clean, 15)
