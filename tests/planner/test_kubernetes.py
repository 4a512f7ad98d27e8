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


class FakeApi:
    """apps/v1 Deployment scale: {namespace: {name: replicas}}; every call recorded as (verb, path, body)."""

    def __init__(self, deployments: dict[str, dict[str, int]], token: str):
        self.state, self.token, self.calls = deployments, token, []
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
                key = self._scale_of()
                if key is None:
                    return self._reply(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                if verb == "patch":
                    patch = json.loads(body)
                    api.state[key[0]][key[1]] = int(patch["spec"]["replicas"])
                self._reply(200, self._scale(*key))

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
