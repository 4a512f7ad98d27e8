"""The kubernetes connector through the real `kubernetes` client against a Kubernetes-API-compatible endpoint
started here (apps/v1 `scale` subresource of two Deployments, GET and PATCH), configured the way the chart
configures the planner pod; and the chart's Role allows exactly the calls the connector made."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

pytest.importorskip("kubernetes")
chart = pytest.importorskip("tests.helm._chart")

PREFIX = "/apis/apps/v1/namespaces/"
PODS = "/api/v1/namespaces/"


class FakeApi:
    """apps/v1 Deployment scale: {namespace: {name: replicas}}; every call recorded as (verb, path, body)."""

    def __init__(self, deployments: dict[str, dict[str, int]], token: str, pods: dict[str, list[dict]] | None = None):
        """`pods`: {namespace: [Pod objects]} for core/v1 pods LIST (labelSelector of `k=v,...`) and PATCH (labels)."""
        self.state, self.token, self.calls, self.pods = deployments, token, [], pods or {}
        api = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _scale_of(self):
                if not self.path.startswith(PREFIX):
                    return None
                parts = self.path[len(PREFIX):].split("?")[0].split("/")
                if len(parts) != 4 or parts[1] != "deployments" or parts[3] != "scale":
                    return None
                ns, name = parts[0], parts[2]
                return (ns, name) if name in api.state.get(ns, {}) else None

            def _reply(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _scale(self, ns, name):
                return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                        "metadata": {"name": name, "namespace": ns},
                        "spec": {"replicas": api.state[ns][name]},
                        "status": {"replicas": api.state[ns][name]}}

            def _handle(self, verb):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                api.calls.append((verb, self.path, self.headers.get("Content-Type"), body))
                if self.headers.get("Authorization") != f"Bearer {api.token}":
                    return self._reply(401, {"kind": "Status", "code": 401})
                if self.path.startswith(PODS):
                    return self._pods(verb, body)
                key = self._scale_of()
                if key is None:
                    return self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                if verb == "patch":
                    patch = json.loads(body)
                    api.state[key[0]][key[1]] = int(patch["spec"]["replicas"])
                self._reply(200, self._scale(*key))

            def _pods(self, verb, body):
                from urllib.parse import parse_qs, urlsplit
                u = urlsplit(self.path)
                parts = u.path[len(PODS):].split("/")
                items = api.pods.get(parts[0], [])
                if verb == "get" and parts[1:] == ["pods"]:
                    sel = parse_qs(u.query).get("labelSelector", [""])[0]
                    want = dict(kv.split("=", 1) for kv in sel.split(",") if kv)
                    got = [p for p in items if want.items() <= p["metadata"]["labels"].items()]
                    return self._reply(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": got})
                pod = next((p for p in items if parts[1:] == ["pods", p["metadata"]["name"]]), None)
                if verb != "patch" or pod is None:
                    return self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                pod["metadata"]["labels"].update(json.loads(body)["metadata"]["labels"])
                self._reply(200, pod)

            def do_GET(self):
                self._handle("get")

            def do_PATCH(self):
                self._handle("patch")

            def do_PUT(self):
                self._handle("update")

            def do_POST(self):
                self._handle("create")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def planner_args(monkeypatch):
    """The planner container of the chart with the planner on, parsed by pdserve's own parser."""
    objs = chart.objects({"planner": {"enabled": True}})
    dep = chart.by_kind(objs, "Deployment")[f"{chart.FULL}-planner"]
    c = chart.pod_template(dep)["containers"][0]
    return chart.parse_pdserve(c, monkeypatch), objs


def test_connector_reads_and_patches_scale_through_the_client(planner_args, tmp_path):
    a, objs = planner_args
    assert a.connector == "kubernetes" and a.namespace == chart.NAMESPACE
    # the names the planner is given are the chart's pool Deployments
    deployments = chart.by_kind(objs, "Deployment")
    assert {a.prefill_deployment, a.decode_deployment} <= set(deployments)
    api = FakeApi({chart.NAMESPACE: {a.prefill_deployment: 1, a.decode_deployment: 2},
                   "other": {"unrelated": 5}}, token="t0ken")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "planner", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "planner"}}]}))
    from pdserve.planner.connectors.kubernetes import KubernetesConnector
    conn = KubernetesConnector(a.namespace, {"prefill": a.prefill_deployment, "decode": a.decode_deployment},
                               kubeconfig=str(kubeconfig))
    assert conn.replicas() == {"prefill": 1, "decode": 2}
    conn.scale("decode", 3)
    conn.scale("prefill", 2)
    assert api.state[chart.NAMESPACE] == {a.prefill_deployment: 2, a.decode_deployment: 3}
    assert conn.replicas() == {"prefill": 2, "decode": 3}
    conn.scale("decode", 1)
    assert api.state[chart.NAMESPACE][a.decode_deployment] == 1 and api.state["other"]["unrelated"] == 5
    patches = [c for c in api.calls if c[0] == "patch"]
    assert [json.loads(c[3]) for c in patches] == [{"spec": {"replicas": n}} for n in (3, 2, 1)]
    assert all("patch" in (c[2] or "") for c in patches)  # a patch media type (merge / strategic merge)

    # the Role allows exactly what was called: the set of (group, resource, name, verb) of every call made equals
    # the Role's grants, and the planner's ServiceAccount is the only subject bound to it
    role = chart.by_kind(objs, "Role")[f"{chart.FULL}-planner"]
    granted = {(g, r, n, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for n in rule.get("resourceNames", ["*"]) for v in rule["verbs"]}
    called = set()
    for verb, path, _, _ in api.calls:
        ns, kind, name, sub = path[len(PREFIX):].split("?")[0].split("/")
        assert ns == chart.NAMESPACE
        called.add(("apps", f"{kind}/{sub}", name, verb))
    assert called == granted
    binding = chart.by_kind(objs, "RoleBinding")[f"{chart.FULL}-planner"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    sa = chart.pod_template(chart.by_kind(objs, "Deployment")[f"{chart.FULL}-planner"])["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": chart.NAMESPACE}]
    # no other Role / ClusterRole in the chart, and no other pod gets the planner's account
    assert set(chart.by_kind(objs, "Role")) == {role["metadata"]["name"]} and not chart.by_kind(objs, "ClusterRole")
    for o, spec in chart.pod_specs(objs):
        if o["metadata"]["name"] != f"{chart.FULL}-planner":
            assert spec.get("serviceAccountName") != sa


def test_wrong_token_is_refused_not_ignored(planner_args, tmp_path):
    a, _ = planner_args
    api = FakeApi({chart.NAMESPACE: {a.prefill_deployment: 1, a.decode_deployment: 1}}, token="right")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "f", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": "wrong"}}],
        "contexts": [{"name": "t", "context": {"cluster": "f", "user": "u"}}]}))
    from kubernetes.client.exceptions import ApiException

    from pdserve.planner.connectors.kubernetes import KubernetesConnector
    conn = KubernetesConnector(a.namespace, {"prefill": a.prefill_deployment, "decode": a.decode_deployment},
                               kubeconfig=str(kubeconfig))
    with pytest.raises(ApiException) as e:
        conn.scale("decode", 2)
    assert e.value.status == 401
    assert api.state[chart.NAMESPACE][a.decode_deployment] == 1


def _kubeconfig(tmp_path, url: str, token: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "f", "cluster": {"server": url}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "t", "context": {"cluster": "f", "user": "u"}}]}))
    return str(path)


class SwitchRecorder:
    """A gRPC endpoint answering the Worker service's SwitchRole as the pod would (switched, or refused); every
    request recorded. The RPC's behaviour itself is tests/e2e/test_role_switch.py's subject."""

    def __init__(self, answers: list[bool]):
        from concurrent import futures

        import grpc

        from pdserve.services.pb import worker_pb2, worker_pb2_grpc
        self.asked: list[tuple[str, float]] = []
        rec = self

        class W(worker_pb2_grpc.WorkerServicer):
            def SwitchRole(self, request, context):
                rec.asked.append((request.role, request.drain_timeout_s))
                ok = answers.pop(0)
                return worker_pb2.SwitchRoleResponse(old_role="decode", role=request.role if ok else "decode",
                                                     switched=ok, seconds=0.4, drain_s=0.1,
                                                     error="" if ok else "drain timeout")

        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        worker_pb2_grpc.add_WorkerServicer_to_server(W(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()


def _pod(name: str, labels: dict, created: str, phase: str = "Running") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": chart.NAMESPACE, "labels": dict(labels), "creationTimestamp": created},
            "status": {"phase": phase, "podIP": "127.0.0.1" if phase == "Running" else None}}


def test_flex_pool_switches_through_the_client_and_the_role_allows_it(tmp_path, monkeypatch):
    objs = chart.objects({"planner": {"enabled": True}, "flex": {"enabled": True, "replicas": 2}})
    a = chart.parse_pdserve(chart.pod_template(chart.by_kind(objs, "Deployment")[f"{chart.FULL}-planner"])
                            ["containers"][0], monkeypatch)
    deps = chart.by_kind(objs, "Deployment")
    flex = chart.parse_pdserve(chart.pod_template(deps[f"{chart.FULL}-flex"])["containers"][0], monkeypatch)
    assert a.flex_port == flex.port and flex.role == "decode"  # the planner dials the flex workers' gRPC port
    # the selector the planner is given finds the flex Deployment's pods, and no pod of the fixed pools
    labels = {p: deps[f"{chart.FULL}-{p}"]["spec"]["template"]["metadata"]["labels"]
              for p in ("flex", "decode", "prefill")}
    want = dict(kv.split("=", 1) for kv in a.flex_selector.split(","))
    assert want.items() <= labels["flex"].items()
    assert not want.items() <= labels["decode"].items() and not want.items() <= labels["prefill"].items()
    worker = SwitchRecorder(answers=[True, False])
    pods = [_pod("rel-pdserve-flex-a", labels["flex"], "2026-01-01T00:00:01Z"),
            _pod("rel-pdserve-flex-b", labels["flex"], "2026-01-01T00:00:02Z"),
            _pod("rel-pdserve-flex-c", labels["flex"], "2026-01-01T00:00:03Z", phase="Pending"),
            _pod("rel-pdserve-decode-x", labels["decode"], "2026-01-01T00:00:04Z")]
    api = FakeApi({chart.NAMESPACE: {a.prefill_deployment: 1, a.decode_deployment: 1}}, token="t",
                  pods={chart.NAMESPACE: pods})
    from types import SimpleNamespace

    from pdserve.planner.connectors.kubernetes import KubernetesConnector
    cfg = _kubeconfig(tmp_path, api.url, "t")
    plain = KubernetesConnector(a.namespace, {"prefill": a.prefill_deployment, "decode": a.decode_deployment},
                                kubeconfig=cfg)
    assert not hasattr(plain, "switch")  # without a flex pool the planner only scales (loop.py)
    conn = KubernetesConnector(a.namespace, {"prefill": a.prefill_deployment, "decode": a.decode_deployment},
                               kubeconfig=cfg, flex_selector=a.flex_selector, flex_port=worker.port,
                               drain_timeout_s=a.drain_timeout)
    # 1 + 1 fixed, two running flex pods in their first role (decode; the pending one serves nothing)
    assert conn.replicas() == {"prefill": 1, "decode": 3}
    assert conn.switch("decode", "prefill") is True
    assert worker.asked == [("prefill", 30.0)]  # the chart's decode drain timeout
    assert [p["metadata"]["labels"]["pdserve.io/role"] for p in pods] == ["decode", "prefill", "decode", "decode"]
    assert conn.replicas() == {"prefill": 2, "decode": 2}
    # the pool's Deployment holds what the flex pods leave: 3 prefill wanted, 1 flex pod serves prefill -> 2
    conn.scale("prefill", 3)
    assert api.state[chart.NAMESPACE][a.prefill_deployment] == 2
    # a refused switch (drain timeout: the worker stays decode) changes no label and says so
    assert conn.switch("decode", "prefill") is False
    assert pods[0]["metadata"]["labels"]["pdserve.io/role"] == "decode"
    # the registry's record wins over the label (a container restarted in the pod came back in its first role)
    conn.observe([SimpleNamespace(worker_id="rel-pdserve-flex-b", role="decode", role_switch="")])
    assert conn.replicas() == {"prefill": 2, "decode": 3}
    conn.observe([SimpleNamespace(worker_id="rel-pdserve-flex-b", role="switching", role_switch="decode->prefill")])
    assert conn.replicas() == {"prefill": 3, "decode": 2}
    conn.scale("decode", 3)  # one flex pod serves decode: the Deployment holds 2
    assert api.state[chart.NAMESPACE][a.decode_deployment] == 2
    worker.server.stop(0)

    # the Role allows exactly the calls made: scale get/patch on the two Deployments, pods list/patch
    role = chart.by_kind(objs, "Role")[f"{chart.FULL}-planner"]
    granted = {(g, r, n, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for n in rule.get("resourceNames", ["*"]) for v in rule["verbs"]}
    called = set()
    for verb, path, _, _ in api.calls:
        if path.startswith(PODS):
            called.add(("", "pods", "*", "list" if path.split("?")[0].endswith("/pods") else verb))
        else:
            ns, kind, name, sub = path[len(PREFIX):].split("?")[0].split("/")
            called.add(("apps", f"{kind}/{sub}", name, verb))
    assert called == granted
