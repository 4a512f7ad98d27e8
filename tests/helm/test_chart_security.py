"""Internal security values (docs/services.md, Trust model) rendered by the real Helm engine: which Secrets exist,
what every pdserve container mounts and reads, how router/worker probes speak TLS, how the bundled Redis takes its
password; each rendered pdserve command line with its env goes through pdserve's own parser."""
from __future__ import annotations

import base64

import pytest

from tests.helm._chart import by_kind, container_env, helm, objects, pod_template, render

FULL = "rel-pdserve"
TOKEN = {"security": {"internalToken": {"enabled": True}}}
TLS = {"security": {"tls": {"enabled": True, "secretName": "pdserve-mtls"}}}
REDIS_AUTH = {"redis": {"auth": {"enabled": True}}}


def _pdserve_containers(objs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """workload name -> (pod spec, its pdserve container)"""
    out = {}
    for kind in ("Deployment", "StatefulSet"):
        for name, o in by_kind(objs, kind).items():
            spec = pod_template(o)
            for c in spec["containers"]:
                if c.get("command") == ["pdserve"]:
                    out[name] = (spec, c)
    return out


def _mounted_file(spec: dict, c: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) behind a file path in the container, through its volumeMounts."""
    vols = {v["name"]: v for v in spec["volumes"]}
    for m in c["volumeMounts"]:
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            return vols[m["name"]]["secret"]["secretName"], path[len(m["mountPath"].rstrip("/")) + 1:]
    raise AssertionError(f"{path} is on no mount of {c['name']}")


def _secret(objs: list[dict], name: str) -> dict[str, str]:
    s = by_kind(objs, "Secret")[name]
    out = dict(s.get("stringData") or {})
    out.update({k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()})
    return out


def test_defaults_are_closed():
    """No values: the chart generates the internal token and the bundled Redis' password, and every pdserve pod
    (gateway, router, both pools, the planner) reads both from the mounted Secrets."""
    objs = objects({"planner": {"enabled": True}})
    secrets = by_kind(objs, "Secret")
    assert len(_secret(objs, f"{FULL}-internal-token")["token"]) == 48
    assert len(_secret(objs, f"{FULL}-redis-auth")["password"]) == 40
    conts = _pdserve_containers(objs)
    assert {n.rsplit("-", 1)[-1] for n in conts} == {"gateway", "router", "prefill", "decode", "planner"}
    for name, (spec, c) in conts.items():
        env = container_env(c)
        assert _mounted_file(spec, c, env["PDSERVE_INTERNAL_TOKEN_FILE"]) == (f"{FULL}-internal-token", "token")
        assert _mounted_file(spec, c, env["PDSERVE_REDIS_PASSWORD_FILE"]) == (f"{FULL}-redis-auth", "password")
        assert "PDSERVE_INSECURE_INTERNAL" not in env and not [k for k in env if k.startswith("PDSERVE_TLS")]
        if name.endswith(("-router", "-prefill", "-decode")):
            assert "grpc" in c["readinessProbe"]  # the kubelet's own probe while there is no TLS
    redis = pod_template(by_kind(objs, "StatefulSet")[f"{FULL}-redis"])
    assert "--aclfile" in redis["containers"][0]["args"]
    assert set(secrets) >= {f"{FULL}-internal-token", f"{FULL}-redis-auth"}


def test_opting_out_is_explicit_and_said_by_every_pod():
    """Token off without mTLS: router and workers run open, with --insecure-internal (each logs what is open); an
    external Redis gets no invented password (its URL carries it)."""
    objs = objects({"security": {"internalToken": {"enabled": False}},
                    "redis": {"enabled": False, "external": {"url": "redis://:pw@redis.example:6379/0"}}})
    assert not [n for n in by_kind(objs, "Secret") if "internal-token" in n or "redis-auth" in n]
    for spec, c in _pdserve_containers(objs).values():
        env = container_env(c)
        assert env["PDSERVE_INSECURE_INTERNAL"] == "1"
        assert "PDSERVE_INTERNAL_TOKEN_FILE" not in env and "PDSERVE_REDIS_PASSWORD_FILE" not in env
    # mTLS alone authenticates callers: no opt-out needed
    objs = objects({"security": {"internalToken": {"enabled": False}, **TLS["security"]}})
    assert not [c for _, c in _pdserve_containers(objs).values() if "PDSERVE_INSECURE_INTERNAL" in container_env(c)]
    # the bundled Redis without a password, asked for
    objs = objects({"redis": {"auth": {"enabled": False}}})
    assert f"{FULL}-redis-auth" not in by_kind(objs, "Secret")


def test_token_generated_and_mounted_by_path():
    objs = objects(TOKEN)
    token = _secret(objs, f"{FULL}-internal-token")["token"]
    assert len(token) == 48 and token.isalnum()
    conts = _pdserve_containers(objs)
    assert {n.rsplit("-", 1)[-1] for n in conts} == {"gateway", "router", "prefill", "decode"}
    for name, (spec, c) in conts.items():
        path = container_env(c)["PDSERVE_INTERNAL_TOKEN_FILE"]
        assert _mounted_file(spec, c, path) == (f"{FULL}-internal-token", "token")
        assert token not in str(c)  # the value never in the pod spec, only the path
    # an existing Secret: nothing generated, that one mounted under its own key
    objs = objects({"security": {"internalToken": {"enabled": True, "existingSecret": "mine", "secretKey": "t"}}})
    assert f"{FULL}-internal-token" not in by_kind(objs, "Secret")
    for spec, c in _pdserve_containers(objs).values():
        assert _mounted_file(spec, c, container_env(c)["PDSERVE_INTERNAL_TOKEN_FILE"]) == ("mine", "t")


def test_rendered_security_env_parses_as_pdserve_flags(monkeypatch, tmp_path):
    """Every rendered variable is one pdserve reads as its flag (a typo in a name would be silently ignored)."""
    from pdserve.cli import build_parser
    objs = objects({"security": {**TOKEN["security"], **TLS["security"]}, **REDIS_AUTH})
    for name, (spec, c) in _pdserve_containers(objs).items():
        env = {k: v for k, v in container_env(c).items() if k.startswith(("PDSERVE_TLS", "PDSERVE_INTERNAL",
                                                                           "PDSERVE_REDIS_PASSWORD"))}
        assert set(env) == {"PDSERVE_INTERNAL_TOKEN_FILE", "PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA",
                            "PDSERVE_TLS_SERVER_NAME", "PDSERVE_REDIS_PASSWORD_FILE"}, name
        for k in [k for k in __import__("os").environ if k.startswith("PDSERVE_")]:
            monkeypatch.delenv(k)
        local = {}
        for k, v in env.items():
            if k == "PDSERVE_TLS_SERVER_NAME":
                local[k] = v
                continue
            secret, key = _mounted_file(spec, c, v)
            f = tmp_path / name / key
            f.parent.mkdir(exist_ok=True)
            f.write_text("x")
            local[k] = str(f)
        for k, v in local.items():
            monkeypatch.setenv(k, v)
        a = build_parser().parse_args([str(x) for x in c["args"]])
        assert a.tls_server_name == "pdserve-internal" and a.tls_ca.endswith("ca.crt")
        assert a.internal_token_file and a.redis_password_file and a.tls_cert.endswith("tls.crt")


def test_tls_mounts_the_secret_and_probes_speak_tls():
    objs = objects(TLS)
    for name, (spec, c) in _pdserve_containers(objs).items():
        env = container_env(c)
        assert _mounted_file(spec, c, env["PDSERVE_TLS_CERT"]) == ("pdserve-mtls", "tls.crt")
        assert _mounted_file(spec, c, env["PDSERVE_TLS_KEY"]) == ("pdserve-mtls", "tls.key")
        assert _mounted_file(spec, c, env["PDSERVE_TLS_CA"]) == ("pdserve-mtls", "ca.crt")
        if name.endswith("-gateway"):
            assert "grpc" in c["livenessProbe"]  # the gateway's own front door stays plaintext (API keys)
            continue
        port = str(c["ports"][0]["containerPort"])
        for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
            pr = c.get(probe)
            if pr is None or "tcpSocket" in pr:
                continue
            assert pr["exec"]["command"][:3] == ["python", "-m", "pdserve.services.health_probe"], (name, probe)
            assert pr["exec"]["command"][3:5] == ["--port", port]
    # without a CA: TLS without client certificates
    objs = objects({"security": {"tls": {"enabled": True, "secretName": "s", "caKey": ""}}})
    for _, c in _pdserve_containers(objs).values():
        assert "PDSERVE_TLS_CA" not in container_env(c)
    with pytest.raises(helm.HelmError, match="security.tls.secretName is required"):
        render({"security": {"tls": {"enabled": True}}})
    for bad in ({"security": {"tls": {"bogus": 1}}}, {"security": {"internalToken": {"secretKey": ""}}},
                {"redis": {"auth": {"user": "x"}}}):
        with pytest.raises(helm.HelmError):
            render(bad)


def test_redis_auth_bundled_server_and_clients_share_the_generated_password():
    objs = objects(REDIS_AUTH)
    sec = _secret(objs, f"{FULL}-redis-auth")
    pw = sec["password"]
    assert len(pw) == 40 and sec["users.acl"] == f"user default on >{pw} ~* &* +@all\n"
    redis = pod_template(by_kind(objs, "StatefulSet")[f"{FULL}-redis"])
    [c] = redis["containers"]
    acl = c["args"][c["args"].index("--aclfile") + 1]
    assert _mounted_file(redis, c, acl) == (f"{FULL}-redis-auth", "users.acl")
    assert container_env(c)["REDISCLI_AUTH"] == f"secret:{FULL}-redis-auth/password"  # the probe's redis-cli
    for spec, c in _pdserve_containers(objs).values():
        assert _mounted_file(spec, c, container_env(c)["PDSERVE_REDIS_PASSWORD_FILE"]) == \
            (f"{FULL}-redis-auth", "password")
    # an external Redis with its password in a Secret of the user's: no ACL file needed, nothing generated
    objs = objects({"redis": {"enabled": False, "external": {"url": "rediss://redis.example:6380/0"},
                              "auth": {"enabled": True, "existingSecret": "ext-redis", "passwordKey": "pw"}}})
    assert f"{FULL}-redis-auth" not in by_kind(objs, "Secret")
    for spec, c in _pdserve_containers(objs).values():
        assert _mounted_file(spec, c, container_env(c)["PDSERVE_REDIS_PASSWORD_FILE"]) == ("ext-redis", "pw")
