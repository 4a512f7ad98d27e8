"""Worker labels (failure domains, price) and router weights in the chart (docs/routing.md, "Failure domains,
price and fairness"; docs/helm.md): the node comes from the downward API, the rest from values, and every
rendered command line parses with pdserve's own parser into the labels the worker publishes."""
from __future__ import annotations

from tests.helm._chart import container_env, objects, parse_pdserve, pdserve_containers


def _workers(values):
    return [(o, c) for o, c in pdserve_containers(objects(values)) if c["args"][0] == "worker"]


def test_worker_node_label_from_the_downward_api(monkeypatch):
    ws = _workers({})
    assert ws
    for _, c in ws:
        env = {e["name"]: e for e in c["env"]}
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert "NODE_ZONE" not in env
        assert parse_pdserve(c, monkeypatch).labels == {"node": "node-1"}


def test_worker_zone_price_and_router_weights(monkeypatch):
    values = {"workers": {"labels": {"zone": "eu-1a", "price": "2"}},
              "router": {"weights": "zone=0.1,node=0.02,price=0.5,fairness=0.01"}}
    for _, c in _workers(values):
        assert parse_pdserve(c, monkeypatch).labels == {"node": "node-1", "zone": "eu-1a", "price": "2"}
    for _, c in _workers({"workers": {"zoneFromTopologyLabel": True}}):
        assert container_env(c)["NODE_ZONE"] == "zone-a"
        assert parse_pdserve(c, monkeypatch).labels == {"node": "node-1", "zone": "zone-a"}
    routers = [c for _, c in pdserve_containers(objects(values)) if c["args"][0] == "router"]
    assert routers
    for c in routers:
        assert parse_pdserve(c, monkeypatch).weights == {"zone": 0.1, "node": 0.02, "price": 0.5, "fairness": 0.01}
