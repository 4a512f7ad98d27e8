"""`pdserve status --redis-url` on a real Redis: workers from the signed registry (a forged record left out), the
planner's signed decision; and the planner's own metrics text parsed back by the scraper's rules."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid

import pytest

from pdserve.kv_transfer import transport
from pdserve.planner.decision import Decision
from pdserve.planner.guard_rails import PoolVerdict
from pdserve.services import planner_record
from pdserve.services.internal_security import InternalSecurity
from pdserve.services.pb import common_pb2
from pdserve.services.registry import Registry, WorkerRecord
from tests.e2e.conftest import ROOT

URL = "redis://127.0.0.1:6379/0"


def _decision(rate: float) -> Decision:
    return Decision(time=1.0, dry_run=False, connector="kubernetes", observed_rate=rate, forecast_rate=rate,
                    hold_rate=rate, trend=0.0, prompt_mean=100, output_mean=10, prefix_hit=0.0, queued=0, slo_ttft=0.5,
                    slo_tpot=0.05, observed_ttft_p90=0.1, observed_tpot_p90=None, simulated_ttft_p90=0.09,
                    simulated_tpot_p90=0.01, feasible=True, note="",
                    pools=[PoolVerdict("prefill", 1, 1, "forecast needs 1"),
                           PoolVerdict("decode", 1, 2, "forecast needs 2")])


@pytest.fixture
def deployment(tmp_path):
    model = f"status-{uuid.uuid4().hex[:8]}"
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123456789abcdef")
    key = InternalSecurity.from_files(str(token)).registry_key()

    async def setup():
        reg = Registry(URL, model, ttl_s=30, key=key)
        for wid, role, running in (("p-0", "prefill", 1), ("d-0", "decode", 3), ("d-1", "decode", 0)):
            await reg.heartbeat(WorkerRecord(wid, role, f"10.0.0.1:{len(wid)}", load=common_pb2.LoadReport(
                worker_id=wid, num_running=running, kv_blocks_in_use=16, kv_blocks_total=64),
                kv_transport=transport.configured({"UCX_TLS": "tcp"} if wid == "d-0" else {}).line()))
        forged = Registry(URL, model, ttl_s=30, key=b"not the key")  # a writer without the token
        await forged.heartbeat(WorkerRecord("evil", "decode", "6.6.6.6:1"))
        d = _decision(2.0)
        await planner_record.store(reg.r, model, d.to_json(), d.changed, key)
        await reg.close()
        await forged.close()

    asyncio.run(setup())
    yield model, token

    async def teardown():
        r = Registry(URL, model).r
        keys = [k async for k in r.scan_iter(f"pdserve:{model}:*")]
        if keys:
            await r.delete(*keys)
        await r.aclose()

    asyncio.run(teardown())


def test_status_json_from_the_registry(deployment):
    model, token = deployment
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "pdserve", "status", "--redis-url", URL, "--model", model,
                          "--internal-token-file", str(token), "--json"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert [(w["id"], w["role"], w["healthy"]) for w in st["workers"]] == [
        ("p-0", "prefill", True), ("d-0", "decode", True), ("d-1", "decode", True)]  # "evil" is not there
    assert st["pools"] == {"prefill": {"replicas": 1, "healthy": 1, "draining": 0},
                           "decode": {"replicas": 2, "healthy": 2, "draining": 0}}
    assert st["workers"][1]["load"]["num_running"] == 3 and st["workers"][1]["load"]["kv_usage"] == 0.25
    last = st["planner"]["last"]
    assert last["pools"][1] == {"pool": "decode", "current": 1, "desired": 2, "reason": "forecast needs 2",
                                "action": "up", "switch_to": ""}
    assert len(st["planner"]["changes"]) == 1
    assert [w["kv_transport"] for w in st["workers"]] == ["UCX/auto (default)", "UCX/tcp (configured)",
                                                          "UCX/auto (default)"]
    out = subprocess.run([sys.executable, "-m", "pdserve", "status", "--redis-url", URL, "--model", model,
                          "--internal-token-file", str(token)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "KV over UCX/tcp (configured)" in out.stdout, out.stdout + out.stderr
    # text form, and a wrong token: the forged-looking decision is not shown
    other = token.parent / "other"
    other.write_text("ffffffffffffffffffffffffffffffff")
    out = subprocess.run([sys.executable, "-m", "pdserve", "status", "--redis-url", URL, "--model", model,
                          "--internal-token-file", str(other)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "planner: no decision recorded" in out.stdout and "pools: no workers" in out.stdout


def test_the_transport_is_what_ucx_tls_configures():
    assert transport.configured({}) == transport.Transport("UCX", "auto", "default")
    assert transport.configured({"UCX_TLS": " rc, tcp ,"}).line() == "UCX/rc,tcp (configured)"


def test_signed_decision_round_trip_and_tamper():
    key = b"k" * 32
    rec = planner_record.sign("m", json.dumps(_decision(1.0).to_json()), key)
    assert planner_record.verify("m", rec, key)["pools"][0]["pool"] == "prefill"
    assert planner_record.verify("m", rec, b"x" * 32) is None
    tampered = json.loads(rec)
    tampered["decision"] = tampered["decision"].replace('"desired": 2', '"desired": 9')
    assert planner_record.verify("m", json.dumps(tampered), key) is None
    assert planner_record.verify("other-model", rec, key) is None


def test_gateway_status_needs_the_metrics_permission(tmp_path):
    from tests.services.gateway.test_hostile import KEYS, Gateway
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    g = Gateway(api_keys_file=str(keys))  # no router behind it
    try:
        assert g.get("/status").status_code == 401
        r = g.get("/status", {"Authorization": "Bearer sk-plain"})
        assert r.status_code == 403 and "workers" not in r.text
        r = g.get("/status", {"Authorization": "Bearer sk-ops"})
        assert r.status_code == 503 and "router" in r.json()["reason"]  # permitted; the router is not there
    finally:
        g.close()


def test_local_state_file_is_never_seen_half_written(tmp_path, monkeypatch):
    """The planner rewrites `up`'s state file at every scale change while `pdserve status` reads it (a CI run of
    tests/e2e/test_planner.py once read it truncated and reported no `up` running): a reader in this process, a
    writer in another, 1 MiB records; every read finds the record."""
    from pdserve.services.status import find_local
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path))
    writer = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from pdserve.services.status import remember_local\n"
        "pad = 'x' * (1 << 20)\n"
        "end = time.monotonic() + 4\n"
        "i = 0\n"
        "while time.monotonic() < end:\n"
        "    remember_local({'redis_url': 'redis://127.0.0.1:6379/0', 'n': i, 'pad': pad})\n"
        "    i += 1\n")], cwd=ROOT, env={"PDSERVE_STATE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)})
    try:
        reads, missed, seen = 0, 0, set()
        while True:
            existed = any(tmp_path.glob("up-*.json"))  # before the read: the writer's first write may come after
            info = find_local()
            if writer.poll() is not None:  # a read after the writer exited finds no live `up`, rightly
                break
            if info is None:
                missed += existed
                continue
            reads += 1
            seen.add(info["n"])
        assert writer.returncode == 0
        assert missed == 0, f"{missed} of {reads + missed} reads found the file but no record"
        assert reads > 100 and len(seen) > 10, (reads, len(seen))  # the two really ran concurrently
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
