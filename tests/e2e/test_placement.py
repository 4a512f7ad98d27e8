"""`pdserve up --placement round-robin`: a deployment selects a placement policy by name (docs/routing.md,
Placement policies); the router passes the two colocated workers requests in turn."""
import shutil

import httpx

from tests.e2e.conftest import Up


def test_round_robin_selected_by_name(tiny_llama):
    model = tiny_llama.parent / "ck"
    if not model.exists():
        shutil.copytree(tiny_llama, model)  # served model name = dir basename "ck"
    d = Up(model, "--mode", "colocated", "--workers", "2", "--placement", "round-robin")
    try:
        routes = []
        for _ in range(4):
            r = httpx.post(d.base_url + "/v1/completions", timeout=30, headers={"x-pdserve-debug": "route"},
                           json={"model": "ck", "prompt": "judge my vow", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            routes.append(dict(kv.split("=", 1) for kv in r.headers["x-pdserve-route"].split(";")))
        assert {x["reason"] for x in routes} == {"round_robin"}
        workers = [x["worker"] for x in routes]
        assert len(set(workers)) == 2 and workers[0::2] == [workers[0]] * 2 and workers[1::2] == [workers[1]] * 2
    finally:
        assert d.stop() == 0
