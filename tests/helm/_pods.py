"""Rendered pods as local processes: each container of the rendered Deployments / StatefulSets becomes one command
line on loopback with exactly the rendered command, args and env and the rendered Secret / ConfigMap files, changed
only where a cluster differs from one host:

- bind addresses (`--host 0.0.0.0`) -> 127.0.0.1, and every container port -> a free local port (all pods share
  one network namespace here);
- Service names (`<svc>:<port>`, in args and env) -> 127.0.0.1 and the local port of the pod behind that Service
  port (selector -> pod, targetPort -> container port);
- volume mount paths -> local directories: a Secret / ConfigMap volume gets its files written out, the model
  volume is a directory holding the test checkpoint at the chart's `subPath`, an emptyDir is an empty directory
  (a `subPath` mount: that subdirectory of it), so the scratch volume's HOME / HF_HOME / /tmp are per pod here too;
- `TORCH_EXTENSIONS_DIR` (the scratch volume's kernel cache) -> this host's own cache, named explicitly (its HOME moved):
  a pod starts with an empty cache, but compiling the native kernels again for every test run (~95 s cold) would
  measure the compiler, not the chart;
- downward-API env: the pod IP is 127.0.0.1, the pod name `<workload>-<replica>`;
- `pdserve` is this interpreter's `-m pdserve` (the image's entrypoint), the Redis image's is `redis-server`.
"""
from __future__ import annotations

import base64
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.helm._chart import pod_template

PORT_FLAGS = ("--port", "--grpc-port", "--metrics-port")
HOST_CACHE_ENV = ("TORCH_EXTENSIONS_DIR",)


def host_kernel_cache() -> str:
    """This host's kernel cache, named explicitly: a pod run here has its HOME on a scratch dir, where torch's
    default (~/.cache/torch_extensions) would be empty and every start would compile the kernels (~90 s)."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                   "torch_extensions")


@dataclass
class LocalPod:
    name: str          # pod name: <workload>-<replica>
    component: str     # app.kubernetes.io/component
    labels: dict[str, str]
    container: dict    # the rendered container
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> local port
    mounts: dict[str, Path] = field(default_factory=dict)  # mountPath -> local dir

    def port(self, name_or_number: str | int) -> int:
        """Local port of a container port given by name (as probes and Services do) or number."""
        if isinstance(name_or_number, int) or str(name_or_number).isdigit():
            return self.ports[int(name_or_number)]
        return self.ports[next(p["containerPort"] for p in self.container["ports"] if p["name"] == name_or_number)]


def _files(obj: dict) -> dict[str, str]:
    out = dict(obj.get("stringData") or {})
    for k, v in (obj.get("data") or {}).items():
        out[k] = base64.b64decode(v).decode() if obj["kind"] == "Secret" else v
    return out


def _free_port() -> int:
    from pdserve.services.ports import free_port
    return free_port()


def plan(objs: list[dict], tmp: Path, model_dir: Path, model_mount: str = "/models") -> list[LocalPod]:
    """Every container of every replica as a LocalPod with its local argv / env / files (nothing started)."""
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    pods: list[LocalPod] = []
    for o in objs:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = pod_template(o)
        labels = o["spec"]["template"]["metadata"]["labels"]
        for i in range(o["spec"].get("replicas", 1)):
            for c in spec["containers"]:
                pods.append(LocalPod(f"{o['metadata']['name']}-{i}", labels["app.kubernetes.io/component"],
                                     labels, c, ports={p["containerPort"]: _free_port() for p in c["ports"]}))
    # Service DNS names -> the local address of (the first replica of) the pod behind each Service port
    hosts: dict[str, str] = {}
    for s in (o for o in objs if o["kind"] == "Service"):
        sel = s["spec"]["selector"]
        behind = [p for p in pods if all(p.labels.get(k) == v for k, v in sel.items())]
        if not behind:
            continue
        for sp in s["spec"]["ports"]:
            hosts[f"{s['metadata']['name']}:{sp['port']}"] = f"127.0.0.1:{behind[0].port(sp['targetPort'])}"

    def rewrite(pod: LocalPod, v: str) -> str:
        for name, local in hosts.items():
            v = re.sub(rf"\b{re.escape(name)}\b", local, v)
        for mount_path, d in sorted(pod.mounts.items(), key=lambda kv: -len(kv[0])):
            if v == mount_path or v.startswith(mount_path + "/"):
                return str(d) + v[len(mount_path):]
        return v

    for pod in pods:
        c = pod.container
        owner = next(o for o in objs if o["kind"] in ("Deployment", "StatefulSet")
                     and pod.name.rsplit("-", 1)[0] == o["metadata"]["name"])
        spec = pod_template(owner)
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            vol = vols[m["name"]]
            d = tmp / pod.name / m["name"] / m.get("subPath", "")
            d.mkdir(parents=True, exist_ok=True)
            if "secret" in vol or "configMap" in vol:
                kind, ref = ("Secret", vol["secret"]["secretName"]) if "secret" in vol \
                    else ("ConfigMap", vol["configMap"]["name"])
                src = by.get((kind, ref))
                assert src is not None, f"{pod.name} mounts {kind} {ref}, which the chart does not render"
                for k, text in _files(src).items():
                    (d / k).write_text(text)
            elif m["mountPath"] == model_mount:  # the model volume (pvc / hostPath / download cache)
                sub = next((str(a) for a in c.get("args", []) if str(a).startswith(model_mount + "/")), "")
                rel = sub[len(model_mount) + 1:].strip("/")  # the chart's model.subPath
                if rel:
                    (d / rel).parent.mkdir(parents=True, exist_ok=True)
                    (d / rel).symlink_to(model_dir, target_is_directory=True)
                else:
                    d.rmdir()
                    d.symlink_to(model_dir, target_is_directory=True)
            pod.mounts[m["mountPath"]] = d
        args = [str(a) for a in c.get("args", [])]
        for j in range(1, len(args)):
            if args[j - 1] in PORT_FLAGS:
                args[j] = str(pod.port(int(args[j])))
            elif args[j - 1] == "--host" and args[j] == "0.0.0.0":
                args[j] = "127.0.0.1"
        args = [rewrite(pod, a) for a in args]
        if c.get("command") == ["pdserve"]:
            pod.argv = [sys.executable, "-m", "pdserve", *args]
        elif c["image"].startswith("redis:") and "command" not in c:  # the image's entrypoint, on loopback
            pod.argv = [shutil.which("redis-server") or "redis-server", *args, "--bind", "127.0.0.1"]
        else:
            raise AssertionError(f"{pod.name}: no local stand-in for {c.get('command') or c['image']}")
        for e in c.get("env", []):
            if "value" in e:
                v = str(e["value"])
            else:
                src = e["valueFrom"]
                if "fieldRef" in src:
                    v = {"status.podIP": "127.0.0.1", "metadata.name": pod.name, "spec.nodeName": "node-local",
                         "metadata.labels['topology.kubernetes.io/zone']": "zone-local"}[src["fieldRef"]["fieldPath"]]
                elif "secretKeyRef" in src:
                    ref = src["secretKeyRef"]
                    v = _files(by[("Secret", ref["name"])])[ref["key"]]
                else:
                    raise AssertionError(f"{pod.name}: env source {src}")
            pod.env[e["name"]] = rewrite(pod, v)
        # Kubernetes expands $(VAR) in args from the container's env
        pod.argv = [re.sub(r"\$\((\w+)\)", lambda m: pod.env.get(m.group(1), m.group(0)), a) for a in pod.argv]
        for name in HOST_CACHE_ENV:
            if name in pod.env:
                assert any(pod.env[name].startswith(str(d) + "/") for d in pod.mounts.values()), \
                    f"{pod.name}: {name}={pod.env[name]} is not on a writable volume"
                pod.env[name] = host_kernel_cache()
        # nothing may still name a cluster address or a path that exists only inside the container
        svc_names = [o["metadata"]["name"] for o in objs if o["kind"] == "Service"]
        # (argv[0] is this host's own interpreter or redis-server: local by construction, wherever the checkout is)
        for v in [*pod.argv[1:], *pod.env.values()]:
            for s in svc_names:
                assert not re.search(rf"\b{re.escape(s)}(\.[a-z0-9.-]+)?:\d+", v), (pod.name, v)
            assert v != "0.0.0.0", (pod.name, v)
            if any(v == str(d) or v.startswith(str(d) + "/") for d in pod.mounts.values()):
                continue  # already local (a local dir may itself lie under a mount path such as /tmp)
            for mp in pod.mounts:
                assert not v.startswith(mp + "/") and v != mp, (pod.name, v)
    return pods
