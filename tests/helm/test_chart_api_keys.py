"""The chart's API-key Secret read by the gateway's own loader: plain keys, tenants in YAML or JSON, an existing
Secret, the checksum that rolls the gateways when the keys change."""
from __future__ import annotations

import pytest

from tests.helm._chart import FULL, SCENARIOS, by_kind, helm, objects, pod_template, render


def _tenants_from_secret(objs, tmp_path, name=f"{FULL}-api-keys"):
    """The keys file as the gateway pod sees it (the Secret's file at the path --api-keys-file names), read by
    the gateway's own loader."""
    from pdserve.services.gateway.tenants import TenantDirectory

    g = pod_template(by_kind(objs, "Deployment")[f"{FULL}-gateway"])
    args = g["containers"][0]["args"]
    path = args[args.index("--api-keys-file") + 1]
    mount = next(m for m in g["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    vol = next(v for v in g["volumes"] if v["name"] == mount["name"])
    assert vol["secret"]["secretName"] == name
    [(key, text)] = by_kind(objs, "Secret")[name]["stringData"].items()
    assert path == f"{mount['mountPath']}/{key}"
    local = tmp_path / key
    local.write_text(text)
    return TenantDirectory(str(local))


def test_api_keys_secret_is_a_file_the_gateway_loads(tmp_path):
    """Whatever form the keys take in values, the Secret holds a file the gateway loads: plain lines under
    `api-keys` (`sk-one\nsk-two\n`) are a keys file too, not a crash-looping gateway."""
    d = _tenants_from_secret(objects(SCENARIOS["gpu"]), tmp_path)
    assert d.authenticate("sk-one").name == d.authenticate("sk-two").name == "default"
    assert d.authenticate("sk-three") is None
    tenants = {"acme": {"keys": ["sk-acme"], "rate_rps": 5, "burst": 10, "quota_tokens": 200000, "priority": 0},
               "team": {"keys": ["sk-team"], "quota_window_s": 60}}
    for key in ("tenants.yaml", "tenants.json", "keys"):
        vals = {"gateway": {"apiKeys": {"enabled": True, "keys": ["sk-plain", "12345"], "defaultTenant": "team",
                                        "tenants": tenants, "secretKey": key}}}
        objs = objects(vals)
        d = _tenants_from_secret(objs, tmp_path)
        acme = d.authenticate("sk-acme")
        assert (acme.name, acme.rate_rps, acme.burst, acme.quota_tokens, acme.priority) == ("acme", 5, 10, 200000, 0)
        for k in ("sk-team", "sk-plain", "12345"):  # plain keys join the default tenant's own
            assert d.authenticate(k).name == "team" and d.authenticate(k).quota_window_s == 60, k
        # the pod template changes with the keys, so a `helm upgrade` with new keys rolls the gateways
        ann = by_kind(objs, "Deployment")[f"{FULL}-gateway"]["spec"]["template"]["metadata"]["annotations"]
        vals["gateway"]["apiKeys"]["keys"] = ["sk-new"]
        ann2 = by_kind(objects(vals), "Deployment")[f"{FULL}-gateway"]["spec"]["template"]["metadata"]["annotations"]
        assert ann["checksum/api-keys"] != ann2["checksum/api-keys"]
    own = objects(SCENARIOS["plain_keys_secret"])
    assert not [n for n in by_kind(own, "Secret") if "api-keys" in n]
    g = pod_template(by_kind(own, "Deployment")[f"{FULL}-gateway"])
    assert g["containers"][0]["args"][-2:] == ["--api-keys-file", "/etc/pdserve/api-keys/api-keys"]
    assert next(v for v in g["volumes"] if v["name"] == "api-keys")["secret"]["secretName"] == "team-keys"
    with pytest.raises(helm.HelmError, match="needs gateway.apiKeys.keys or gateway.apiKeys.tenants"):
        render({"gateway": {"apiKeys": {"enabled": True}}})
    with pytest.raises(helm.HelmError):  # a tenant without keys
        render({"gateway": {"apiKeys": {"enabled": True, "tenants": {"acme": {"rate_rps": 1}}}}})
