"""Mid-stream migration against a real `pdserve up --mode disagg` (Redis, router, two prefill and three decode
workers, gateway; tiny model, each engine step slowed to 30 ms so that a stream is long enough to break, each KV
pull delayed 1 s): the serving decode worker is SIGKILLed (or SIGSTOPped: it stops answering and leaves the
registry) after some tokens went out, or the prefill worker holding the prompt's KV is SIGKILLed before the pull,
and the client's stream goes on on another worker (docs/reliability.md, "Mid-stream migration").

References are independent of the serving path: the offline engine's uninterrupted run of the same request
(greedy, and seeded sampling). Also checked: the migration limit (`--migration-limit 1`) ends a request that breaks
once more with an error event instead of a hang; one usage record per request, with the migration and the
recomputed tokens; `pdserve_migrations_total{reason}`; no KV blocks, pins or reservations left afterwards.
"""
from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from pdserve.services.up_process import UpProcess
from tests.e2e.conftest import NUM_BLOCKS, ROOT, metric, served_as_ck, wait_until

PROMPT = "the quick brown fox"
STEP_DELAY_S = 0.03
PULL_DELAY_S = 1.0  # the decode side waits this long before pulling a prompt's KV: a window to kill its source


@pytest.fixture(scope="module")
def up(tiny_llama, tmp_path_factory):
    model, _ = served_as_ck(tiny_llama, tmp_path_factory, "tenants: {}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PDSERVE_LOG_LEVEL": "INFO",  # INFO: the billing records
           "PDSERVE_FAULT_STEP_DELAY_S": str(STEP_DELAY_S), "PDSERVE_FAULT_PULL_DELAY_S": str(PULL_DELAY_S)}
    d = UpProcess(["--no-restart", "--model", str(model), "--num-gpu-blocks", str(NUM_BLOCKS), "--mode", "disagg", "--prefill", "2",
                   "--decode", "3", "--migration-limit", "1", "--heartbeat-ttl", "2"], env, 120)
    yield d
    d.stop()


def _reference(tiny_llama, **kw) -> str:
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    eng = Engine.from_pretrained(str(tiny_llama), EngineConfig(num_gpu_blocks=NUM_BLOCKS))
    return eng.generate([PROMPT], SamplingParams(ignore_eos=True, **kw))[0].outputs[0].text


class Stream:
    """One streaming completion read event by event; `route` is the worker ids of its first placement."""

    def __init__(self, up, **body):
        self.client = httpx.Client(timeout=60)
        self.cm = self.client.stream("POST", up.base_url + "/v1/completions", headers={"x-pdserve-debug": "route"},
                                     json={"model": "ck", "prompt": PROMPT, "stream": True, "ignore_eos": True,
                                           "stream_options": {"include_usage": True}, **body})
        self.r = self.cm.__enter__()
        assert self.r.status_code == 200, self.r.read()
        self.route = dict(kv.split("=", 1) for kv in self.r.headers["x-pdserve-route"].split(";"))
        self.lines = self.r.iter_lines()
        self.text, self.events, self.usage, self.error, self.done, self.id = "", 0, None, None, False, None

    def read(self, events: int | None = None) -> None:
        """Read `events` more choice events (None: to the end)."""
        want = None if events is None else self.events + events
        for line in self.lines:
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                self.done = True
                break
            ev = json.loads(line[6:])
            if "error" in ev:
                self.error = ev["error"]
                break
            self.id = ev.get("id", self.id)
            if ev.get("usage"):
                self.usage = ev["usage"]
            for c in ev.get("choices", []):  # one per message with tokens (its text may be held back: "")
                self.text += c.get("text") or ""
                self.events += 1
            if want is not None and self.events >= want:
                return
        self.cm.__exit__(None, None, None)
        self.client.close()


def _pid(up, worker_id: str) -> int:
    return next(p["pid"] for p in up.workers() if p["worker_id"] == worker_id)


def _record(up, rid: str) -> dict:
    """The gateway's billing record of request `rid` (one JSON line of the pdserve.billing logger)."""
    found: list[dict] = []

    def seen() -> bool:
        found[:] = [json.loads(line[line.index("{"):]) for line in list(up.lines)
                    if " pdserve.billing" in line and f'"request_id": "{rid}"' in line]
        return bool(found)

    assert wait_until(seen, 10), f"no billing record for {rid}"
    assert len(found) == 1, found  # exactly one per client request
    return found[0]


def test_migration_limit_ends_with_an_error_not_a_hang(up):
    """SIGSTOP the serving decode worker: silent, it leaves the registry and the stream moves (worker_lost); then
    SIGSTOP the new one: the limit (1) is spent, so the stream ends with an error event, within seconds."""
    s = Stream(up, max_tokens=400, temperature=0)
    s.read(3)
    first = s.route["decode"]
    os.kill(_pid(up, first), signal.SIGSTOP)
    try:
        before, t0 = s.events, time.monotonic()
        s.read(1)  # goes on on another worker (local prefill of prompt + the tokens sent)
        print(f"SIGSTOP of the decode worker -> next event {time.monotonic() - t0:.2f} s")
        s.read(2)
        assert s.events >= before + 3 and s.error is None
    finally:
        os.kill(_pid(up, first), signal.SIGCONT)
    # the worker now serving it: the one decode worker with a running request
    def serving() -> list[str]:
        return [p["worker_id"] for p in up.workers("decode") if p["worker_id"] != first
                and metric(p["metrics_port"], "pdserve_num_running") > 0]
    assert wait_until(lambda: len(serving()) == 1, 10)
    second = serving()[0]
    os.kill(_pid(up, second), signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        s.read()
        waited = time.monotonic() - t0
    finally:
        os.kill(_pid(up, second), signal.SIGCONT)
    assert s.error is not None and not s.done, (s.error, s.done)
    assert s.error["code"] == "failed", s.error  # the client sees a failure, its detail stays in the record
    print(f"SIGSTOP of the second worker -> error event {waited:.2f} s")
    assert waited < 2 * 2 + 3, waited  # two heartbeat TTLs (2 s) + the stall check, with slack for a loaded box
    rec = _record(up, s.id)
    assert rec["state"] == "FAILED" and rec["migrations"] == 1 and rec["recomputed_tokens"] > 0, rec
    assert "migration limit reached" in rec["error"], rec
    assert metric(up.port, "pdserve_migrations_total", '{reason="worker_lost"}') == 1


def test_prefill_death_before_the_pull_is_reprefilled(up, tiny_llama):
    """The first token went out from the Prefill reply; the prefill worker holding the prompt's KV dies before the
    decode worker pulls it. The pull fails (retryable), and the request is prefilled again elsewhere with that
    token: the stream goes on, the same text as uninterrupted."""
    want = _reference(tiny_llama, max_tokens=24, temperature=0)
    s = Stream(up, max_tokens=24, temperature=0)
    s.read(1)  # the first token, from the Prefill reply: the decode side now waits PULL_DELAY_S before its pull
    os.kill(_pid(up, s.route["prefill"]), signal.SIGKILL)
    t0 = time.monotonic()
    s.read(1)
    print(f"SIGKILL of the prefill worker before the pull -> next event {time.monotonic() - t0:.2f} s "
          f"(the pull waits {PULL_DELAY_S} s)")
    s.read()
    assert s.error is None and s.done, s.error
    assert s.text == want, (s.text, want)
    rec = _record(up, s.id)
    assert rec["state"] == "FINISHED" and rec["migrations"] == 1 and rec["recomputed_tokens"] > 0, rec
    assert metric(up.port, "pdserve_migrations_total", '{reason="kv_transfer"}') == 1


@pytest.mark.parametrize("kind", ["seeded", "greedy"])
def test_sigkill_mid_stream_migrates_to_the_same_output(up, tiny_llama, kind):
    params = dict(temperature=0) if kind == "greedy" else dict(temperature=1.0, top_p=0.9, seed=1234)
    want = _reference(tiny_llama, max_tokens=48, **params)
    before = metric(up.port, "pdserve_migrations_total", '{reason="unavailable"}')
    before = 0 if before != before else before  # NaN: no sample yet
    # both remaining decode workers must be registered again (the previous test stopped them for a while)
    s = Stream(up, max_tokens=48, **params)
    s.read(8)
    victim = s.route["decode"]
    os.kill(_pid(up, victim), signal.SIGKILL)
    t0 = time.monotonic()
    s.read(1)
    print(f"SIGKILL of the decode worker ({kind}) -> next event {time.monotonic() - t0:.2f} s")
    s.read()
    assert s.error is None and s.done, s.error
    assert s.text == want, (s.text, want)
    assert s.usage["completion_tokens"] == 48
    rec = _record(up, s.id)
    assert rec["state"] == "FINISHED" and rec["migrations"] == 1, rec
    # the new worker prefilled prompt + the tokens sent (8 events: at least 8 tokens), less its prefix-cache hits
    assert 0 < rec["recomputed_tokens"] <= rec["prompt_tokens"] + 48, rec
    assert rec["committed_tokens"] == 48 and rec["emitted_tokens"] == 48, rec
    assert metric(up.port, "pdserve_migrations_total", '{reason="unavailable"}') == before + 1


def test_nothing_left_behind(up):
    """After the kills and stops: every live worker holds no KV blocks and no pins, Redis no reservations."""
    r = up.redis()
    live = [p for p in up.workers() if _alive(p["pid"])]
    assert len(live) == 2  # one prefill worker and one decode worker survive

    def clean() -> bool:
        return (all(metric(p["metrics_port"], "pdserve_kv_blocks_in_use") == 0
                    and metric(p["metrics_port"], "pdserve_kv_blocks_pinned") == 0 for p in live)
                and r.zcard("pdserve:ck:reservations") == 0)

    assert wait_until(clean, 15)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by `up`) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
