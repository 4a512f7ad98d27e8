"""Redis in the rendered chart: the bundled StatefulSet (no persistence) or an external URL (from values or an
existing Secret), never written into a pod spec."""
from __future__ import annotations

import json

from tests.helm._chart import FULL, SCENARIOS, by_kind, objects, pod_template


def test_redis_bundled_or_external():
    objs = objects()
    ss = by_kind(objs, "StatefulSet")[f"{FULL}-redis"]
    args = pod_template(ss)["containers"][0]["args"]
    assert args[args.index("--save") + 1] == "" and args[args.index("--appendonly") + 1] == "no"
    # no URL Secret: only the generated internal token and Redis password (closed by default)
    assert set(by_kind(objs, "Secret")) == {f"{FULL}-internal-token", f"{FULL}-redis-auth"}

    ext = objects(SCENARIOS["external_redis"])
    assert not by_kind(ext, "StatefulSet")
    sec = by_kind(ext, "Secret")[f"{FULL}-redis-url"]
    assert sec["stringData"]["redis-url"] == "rediss://:s3cret@redis.example.internal:6380/2"
    for name in (f"{FULL}-router", f"{FULL}-prefill", f"{FULL}-decode"):
        env = pod_template(by_kind(ext, "Deployment")[name])["containers"][0]["env"]
        ref = next(e for e in env if e["name"] == "PDSERVE_REDIS_URL")["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"{FULL}-redis-url", "key": "redis-url"}
    assert "s3cret" not in json.dumps(by_kind(ext, "Deployment"))

    own = objects(SCENARIOS["external_redis_secret"])
    # the user's URL Secret: none made for it, no password invented for its Redis (only the internal token)
    assert set(by_kind(own, "Secret")) == {f"{FULL}-internal-token"} and not by_kind(own, "StatefulSet")
    env = pod_template(by_kind(own, "Deployment")[f"{FULL}-router"])["containers"][0]["env"]
    assert next(e for e in env if e["name"] == "PDSERVE_REDIS_URL")["valueFrom"]["secretKeyRef"] == \
        {"name": "team-redis", "key": "url"}
