"""`pdserve up --planner --mode disagg` switches a decode worker to prefill on a load shift, by itself.

One deployment of the built-in model, 1 prefill + 2 decode workers, deterministic mode (a request's greedy tokens
are then bit for bit what it gets served alone, whichever workers and batches served it). Closed-loop clients send
short prompts with long outputs, then long prompts with short outputs: the one prefill worker's TTFT breaks the
SLO (set between the two phases' TTFTs on this box), the planner confirms the grow over 2 intervals, and since the
decode pool's measured load then needs one worker of its two (planner/surplus.py) it switches one - while the
simulator's capacities for the new lengths are still being computed, or before any were (the case the old rule,
switch only against a "down", never switched in: it started a third worker).

Checked: the decision says "switch" (its line in the log, `pdserve status --json`), the worker's own counter
`pdserve_role_switches_total{from_role="decode",to_role="prefill"}` is 1, the registry shows it as prefill, the
router places a prompt on it as prefill (the route header), no worker was started or drained, no request failed,
and requests served before and after the switch - among them ones the switched worker prefilled - have exactly
the offline engine's tokens for the same prompt alone (greedy). The figures (decision -> registered in the new
role -> first prompt prefilled there) are printed for docs/planner.md.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from pdserve.services.status import gather
from pdserve.services.up_process import UpProcess
from tests.e2e.conftest import ROOT, metric

CLIENTS = 3
INTERVAL = 2.0
SLO_TTFT = 1.0      # short prompts here: TTFT p90 0.1-0.35 s; 800-token prompts on one prefill worker: 2-5 s
SHORT = (20, 48)    # (prompt words, output tokens)
LONG = (420, 4)
PHASE_A_S = 8.0
WORDS = Path(ROOT, "pdserve/builtin/model/heldout.txt").read_text().split()


def prompt(i: int, words: int) -> str:
    """A prompt of its own (a unique head: no prefix-cache hit, so every prompt costs its whole prefill)."""
    start = (i * 131) % (len(WORDS) - words)
    return f"{os.urandom(4).hex()} {i}: " + " ".join(WORDS[start:start + words])


def complete(c: httpx.Client, model: str, text: str, max_tokens: int) -> dict:
    r = c.post("/v1/completions", headers={"x-pdserve-debug": "route"}, json={
        "model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    route = r.headers.get("x-pdserve-route", "").split(" | ")[-1]
    ids = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None
    return {"code": r.status_code, "body": r.text[:300] if r.status_code != 200 else "", "prompt": text,
            "max_tokens": max_tokens, "ids": ids, "t": time.monotonic(),
            "route": dict(kv.split("=", 1) for kv in route.split(";") if "=" in kv)}


def client(base: str, model: str, shape: dict, stop: threading.Event, k: int) -> list[dict]:
    out, i = [], k
    with httpx.Client(base_url=base, timeout=60) as c:
        while not stop.is_set():
            words, max_tokens = shape["now"]
            out.append(complete(c, model, prompt(i, words), max_tokens))
            i += CLIENTS
    return out


def status() -> dict | None:
    """What `pdserve status --json` prints for the local `up` (its state file: $PDSERVE_STATE_DIR)."""
    return gather(argparse.Namespace(url=None, redis_url=None, model=None, api_key=None, internal_token_file=None,
                                     redis_password_file=None, redis_ca_file=None))


def reference(recs: list[dict]) -> list[list[int]]:
    """The offline deterministic engine, each prompt alone, uncached: what each request must have got."""
    from pdserve.builtin import builtin_model_dir
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    eng = Engine.from_pretrained(str(builtin_model_dir()), EngineConfig(num_gpu_blocks=512, deterministic=True,
                                                                enable_prefix_caching=False))
    return [list(eng.generate([r["prompt"]], SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                                                            ignore_eos=True))[0].outputs[0].token_ids)
            for r in recs]


def _planner_lines(up) -> str:
    """The planner's decisions and actions, each cut to its verdicts."""
    return "\n".join(x[x.index("planner: "):][:420] for x in up.lines if "planner: " in x)


def test_load_shift_switches_a_decode_worker_to_prefill(tmp_path, monkeypatch):
    t_start = time.monotonic()
    state = str(tmp_path / "state")
    monkeypatch.setenv("PDSERVE_STATE_DIR", state)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "INFO", "PDSERVE_STATE_DIR": state}
    up = UpProcess(["--model", "builtin", "--deterministic", "--num-gpu-blocks", "512", "--mode", "disagg",
                    "--prefill", "1", "--decode", "2", "--planner", "--planner-interval", str(INTERVAL),
                    "--min-prefill", "1", "--max-prefill", "2", "--min-decode", "1", "--max-decode", "2",
                    "--slo-ttft", str(SLO_TTFT), "--slo-tpot", "0.25", "--planner-window", "2"], env,
                   ready_timeout=120)
    stop = threading.Event()
    try:
        model = up.info["model"]
        decode_ids = {w["worker_id"]: w for w in up.workers("decode")}
        pids = sorted(w["pid"] for w in status()["workers"])
        shape = {"now": SHORT}
        with cf.ThreadPoolExecutor(CLIENTS) as pool:
            runs = [pool.submit(client, up.base_url, model, shape, stop, k) for k in range(CLIENTS)]
            time.sleep(PHASE_A_S)
            shape["now"] = LONG
            t_shift, wall_shift = time.monotonic(), time.time()
            # the planner switches a decode worker: its registry record says prefill
            switched, t_registered, wall_registered = None, None, None
            while time.monotonic() < t_shift + 40 and switched is None:
                for w in (status() or {}).get("workers", []):
                    if w["id"] in decode_ids and w["role"] == "prefill" and w["healthy"]:
                        switched, t_registered, wall_registered = w["id"], time.monotonic(), time.time()
                time.sleep(0.2)
            # ... and the router places prompts on it as prefill (its engine times a prefill)
            t_served = None
            while switched and time.monotonic() < t_registered + 20 and t_served is None:
                if metric(decode_ids[switched]["metrics_port"], "pdserve_prefill_time_seconds_count") >= 1:
                    t_served = time.monotonic()
                time.sleep(0.2)
            time.sleep(2.0)  # a few more long requests through the new split
            st = status()    # while the load still runs: the pools as the switch left them
            stop.set()
            recs = [r for f in runs for r in f.result()]
        assert switched is not None, "no switch:\n" + _planner_lines(up)
        # the decision that did it: action "switch", and why
        changes = st["planner"]["changes"]
        sw = [(c, p) for c in changes for p in c["pools"] if p["action"] == "switch"]
        assert len(sw) == 1 and sw[0][1]["pool"] == "decode" and sw[0][1]["switch_to"] == "prefill", changes[:3]
        # why decode may give one: its measured load (while the model's capacities lag the shift), or the model's
        # own count for the long lengths once they are computed (a decode replica serves far more than this load;
        # before tests/planner/test_decode_count_long_prompts.py's fix that count was 2 in 1 run of 7)
        assert ("measured load needs 1 of 2 decode" in sw[0][1]["reason"]
                or "every recent interval needed at most 1" in sw[0][1]["reason"]), sw[0][1]
        grown = next(p for p in sw[0][0]["pools"] if p["pool"] == "prefill")
        assert grown["action"] == "up" and "1 by role switch from decode" in grown["reason"]
        assert sw[0][0]["time"] > wall_shift  # on the shift, not before it
        assert "decode 2->1 [switch: 1 to prefill" in "".join(up.lines)
        planner_port = up.info["planner"]["metrics_port"]
        assert metric(planner_port, "pdserve_planner_decisions_total", '{pool="decode",action="switch"}') == 1
        # the pools: 2 prefill (one of them the switched worker), 1 decode, the same three processes (no worker
        # started, none drained), nothing changed but by the switch
        assert st["pools"]["prefill"]["replicas"] == 2 and st["pools"]["decode"]["replicas"] == 1, st["pools"]
        assert sorted(w["pid"] for w in st["workers"]) == pids
        assert [p["action"] for c in changes for p in c["pools"] if p["action"] != "hold"] == ["up", "switch"]
        mport = decode_ids[switched]["metrics_port"]
        assert metric(mport, "pdserve_role_switches_total",
                      '{from_role="decode",to_role="prefill",outcome="switched"}') == 1
        # `pdserve status` says it
        out = subprocess.run([sys.executable, "-m", "pdserve", "status"], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0 and "(switch: 1 to prefill: " in out.stdout, out.stdout + out.stderr
        # the new role served: prompts placed on it as prefill
        as_prefill = [r for r in recs if r["route"].get("prefill") == switched]
        assert t_served is not None and as_prefill, "the switched worker prefilled no prompt"
        # no request failed; a few, before and after the switch (some prefilled by the switched worker), have
        # exactly the offline engine's tokens
        bad = [r for r in recs if r["code"] != 200]
        assert not bad, bad[:3]
        before = [r for r in recs if r["t"] < t_shift and r["route"].get("decode") == switched][:2]
        checked = before + as_prefill[:3]
        assert len(checked) >= 4 and [r["ids"] for r in checked] == reference(checked)
        t_decided = sw[0][0]["time"]  # the decision record's unix time: taken when decided, before the switch
        print(f"\nswitch: shift -> decision {t_decided - wall_shift:.2f} s, decision -> registered as prefill "
              f"{wall_registered - t_decided:.2f} s (seen by polling, 0.2 s), registered -> first prefill there "
              f"{t_served - t_registered:.2f} s; {len(recs)} requests, {len(bad)} failed, {len(as_prefill)} "
              f"prefilled by the switched worker; checked {len(checked)}; test wall {time.monotonic() - t_start:.1f} s")
        print(_planner_lines(up))
    finally:
        stop.set()
        up.stop()
