"""Pod templates of the rendered chart: every container restricted by default (Pod Security Standard
`restricted`, writable emptyDirs for what pdserve writes), the default UID the images', overrides, extra volumes,
pod labels and runtime class."""
from __future__ import annotations

import re

import pytest
import yaml

from tests.helm._chart import (
    CHART,
    FULL,
    SCENARIOS,
    by_kind,
    container_env,
    helm,
    objects,
    pod_specs,
    pod_template,
    render,
)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_container_is_restricted_by_default(scenario):
    """Pod Security Standard `restricted` for every container (init containers included), and a writable
    emptyDir for everything pdserve writes (HOME, /tmp, compiled kernels, the hub cache) under the read-only root."""
    objs = objects(SCENARIOS[scenario])
    n = 0
    for o, spec in pod_specs(objs):
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0 and psc["fsGroup"] != 0
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
        vols = {v["name"]: v for v in spec["volumes"]}
        for c in spec.get("initContainers", []) + spec["containers"]:
            n += 1
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (o["metadata"]["name"], c["name"])
            assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}  # RDMA pinned memory only
            writable = {m["mountPath"] for m in c.get("volumeMounts", [])
                        if "emptyDir" in vols[m["name"]] or not m.get("readOnly")}
            if c["name"] == "redis":
                assert "/data" in writable
                continue
            assert "/tmp" in writable
            env = container_env(c)
            for k in ("HOME", "TORCH_EXTENSIONS_DIR", "HF_HOME"):
                assert any(env[k] == w or env[k].startswith(w + "/") for w in writable), (c["name"], k, env[k])
    assert n >= 4


def test_default_uid_is_the_images_user():
    """The chart's default UID/GID is the user docker/Dockerfile and docker/Dockerfile.cpu create and run as."""
    from tests.helm._chart import ROOT
    chart = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]
    for df in ("Dockerfile", "Dockerfile.cpu"):
        text = (ROOT / "docker" / df).read_text()
        uid = int(re.search(r"^USER (\d+)$", text, re.M).group(1))
        assert re.search(rf"useradd --uid {uid} ", text)
        assert chart["runAsUser"] == uid and chart["fsGroup"] == uid and chart["runAsGroup"] == uid, df


def test_security_context_is_overridable():
    vals = {"podSecurityContext": {"runAsUser": 2000, "fsGroup": None},
            "securityContext": {"readOnlyRootFilesystem": None},
            "gateway": {"securityContext": {"readOnlyRootFilesystem": True, "runAsUser": 3000}},
            "decode": {"securityContext": {"capabilities": {"drop": ["ALL"], "add": ["SYS_NICE"]}}}}
    d = by_kind(objects(vals), "Deployment")
    for name, dep in d.items():
        spec = pod_template(dep)
        assert spec["securityContext"]["runAsUser"] == 2000 and "fsGroup" not in spec["securityContext"]
        sc = spec["containers"][0]["securityContext"]
        if name == f"{FULL}-gateway":
            assert sc["readOnlyRootFilesystem"] is True and sc["runAsUser"] == 3000
        else:
            assert "readOnlyRootFilesystem" not in sc
        assert sc["allowPrivilegeEscalation"] is False
        caps = {"drop": ["ALL"], "add": ["SYS_NICE"]} if name == f"{FULL}-decode" else {"drop": ["ALL"]}
        assert sc["capabilities"] == caps, name


def test_extra_volumes_labels_and_runtime_class():
    vals = SCENARIOS["extras_hf_podmonitor"]
    objs = objects(vals)
    d = by_kind(objs, "Deployment")
    for name, dep in d.items():
        comp = name.removeprefix(FULL + "-")
        spec, labels = pod_template(dep), dep["spec"]["template"]["metadata"]["labels"]
        assert labels["team"] == "ml"
        assert labels.get("tier") == ("edge" if comp == "gateway" else None)
        assert labels.get("pool") == ("fast" if comp == "decode" else None)
        assert set(dep["spec"]["selector"]["matchLabels"]) <= set(labels)
        assert {"team", "tier", "pool"}.isdisjoint(dep["spec"]["selector"]["matchLabels"])
        assert spec.get("runtimeClassName") == {"prefill": "nvidia", "decode": "nvidia-cdi"}.get(comp)
        vols = [v["name"] for v in spec["volumes"]]
        mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
        assert "ca" in vols and mounts["ca"] == {"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}
        assert (("kcache" in vols), ("kcache" in mounts)) == ((comp != "gateway" and comp != "router"),) * 2
    redis = by_kind(objs, "StatefulSet")[f"{FULL}-redis"]
    assert redis["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    with pytest.raises(helm.HelmError, match="podLabels may not set app.kubernetes.io/component"):
        render({"router": {"podLabels": {"app.kubernetes.io/component": "x"}}})
