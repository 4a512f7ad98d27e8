"""The lab cluster's command lines (pdserve/lab/cluster.py), built without namespaces: the network and the
supervisor are stand-ins that record what would run where. Starting a real lab is tests/e2e/test_lab.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.bench.chaos_lab import LabChaosDeployment
from pdserve.cli import build_parser
from pdserve.lab import cluster as lab_cluster
from pdserve.lab.cluster import LabCluster, LabSpec


class _Net:
    def __init__(self, tag=None):
        self.hosts = {}

    def add_host(self, name, link=None):
        h = SimpleNamespace(name=name, ip=f"10.0.0.{len(self.hosts) + 2}", exec_prefix=lambda: [])
        self.hosts[name] = h
        return h

    def close(self):
        pass


class _Sup:
    def __init__(self, env, restart, log):
        self.cmds, self.restart = {}, restart

    def start(self, name, cmd, info, stdin_data=None, relay=False):
        self.cmds[name] = cmd

    def stop_all(self, timeout):
        pass


@pytest.fixture
def started(monkeypatch):
    monkeypatch.setattr(lab_cluster, "Network", _Net)
    monkeypatch.setattr(lab_cluster, "Supervisor", _Sup)
    monkeypatch.setattr(LabCluster, "_wait_ready", lambda self, end: None)
    made = []

    def start(spec: LabSpec) -> tuple[LabCluster, dict[str, list[str]]]:
        c = LabCluster(spec)
        made.append(c)
        cmds = dict(c.start().sup.cmds)  # close() drops the supervisor
        return c, cmds
    yield start
    for c in made:
        c.close()


def _parsed(cmd: list[str]):
    return build_parser().parse_args(cmd[cmd.index("pdserve") + 1:])  # after `python -m pdserve`


@pytest.mark.parametrize("ttl", [3.0, 1.5])
def test_heartbeat_ttl_reaches_the_router_and_every_worker(started, ttl):
    """What the harness times its cases by (the deployment's `ttl`) is what the processes run with."""
    c, cmds = started(LabSpec(prefill=1, decode=2, heartbeat_ttl=ttl))
    for name in ("router", "prefill-0", "decode-0", "decode-1"):
        assert _parsed(cmds[name]).heartbeat_ttl == ttl, name
    assert LabChaosDeployment(c).ttl == ttl


def test_pdserve_lab_passes_its_heartbeat_ttl(monkeypatch):
    """`pdserve lab --heartbeat-ttl` is the spec's: the cluster it builds runs its router and workers with it."""
    from pdserve.lab.netns import LabUnavailable
    seen = []

    def cluster(spec):
        seen.append(spec)
        raise LabUnavailable("stand-in: no namespaces needed to check the spec")
    monkeypatch.setattr(lab_cluster, "LabCluster", cluster)
    a = build_parser().parse_args(["lab", "--heartbeat-ttl", "1.5"])
    assert a.func(a) == 2 and seen[0].heartbeat_ttl == 1.5
    a = build_parser().parse_args(["lab"])
    assert a.func(a) == 2 and seen[1].heartbeat_ttl == LabSpec().heartbeat_ttl
