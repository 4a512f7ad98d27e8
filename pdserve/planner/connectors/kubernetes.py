"""Scale the prefill and decode Deployments through the Kubernetes API (the official `kubernetes` client), and
switch the role of the flex pool's pods (workers that may serve either role).

Scaling: two calls on the `scale` subresource of the two Deployments the chart names (`<release>-pdserve-prefill`,
`<release>-pdserve-decode`): GET (`read_namespaced_deployment_scale`) and PATCH (`patch_namespaced_deployment_scale`,
body `{"spec": {"replicas": n}}`). The chart's Role grants `get` and `patch` on `deployments/scale` for those two
names. Removing a pod is Kubernetes' choice of pod; its SIGTERM drains it (the worker leaves the registry, finishes
its requests, within terminationGracePeriodSeconds: docs/helm.md).

Switching (`flex_selector` given: the chart's `flex` pool): a pool counts its Deployment's replicas plus the flex
pods serving its role. `switch(src, dst)` takes the newest running flex pod serving `src`, calls its SwitchRole RPC
at podIP:`flex_port` (services/role_switch.py: it drains the old role and registers the new one, in its process),
then labels the pod `pdserve.io/role: dst` (LIST and PATCH on pods: the chart's Role grants those two when the
flex pool is on). A flex pod's role is its registry record's (`observe`: the worker id is the pod name) when the
planner has one: a container restarted in the same pod comes back in its first role whatever the label says.
`scale(pool, n)` sets the Deployment to what the flex pods of that role leave (never below 0): flex pods move by
switching only.

Credentials: in a pod, the ServiceAccount (in-cluster config); elsewhere a kubeconfig (--kubeconfig, else
$KUBECONFIG / ~/.kube/config).
"""
from __future__ import annotations

import logging
import os

from pdserve.planner.connectors import POOLS

log = logging.getLogger("pdserve.planner")
ROLE_LABEL = "pdserve.io/role"


class KubernetesConnector:
    name = "kubernetes"

    def __init__(self, namespace: str, deployments: dict[str, str], kubeconfig: str | None = None,
                 context: str | None = None, flex_selector: str | None = None, flex_port: int = 50051,
                 drain_timeout_s: float = 30.0):
        from kubernetes import client, config
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            config.load_kube_config(config_file=kubeconfig, context=context)
        self.api = client.AppsV1Api()
        self.core = client.CoreV1Api()
        self.namespace = namespace
        self.deployments = deployments  # pool -> Deployment name
        self.flex_selector, self.flex_port, self.drain_timeout_s = flex_selector, flex_port, drain_timeout_s
        self.registered: dict[str, str] = {}  # worker id (pod name) -> role, from the registry
        if flex_selector:
            self.switch = self._switch  # the planner switches only where the connector can (loop.py: hasattr)

    def observe(self, workers) -> None:
        """The loop hands over each interval's live registry records (WorkerRecord)."""
        self.registered = {w.worker_id: (w.role_switch.split("->")[-1] if w.role_switch else w.role)
                           for w in workers}

    def flex_pods(self) -> list[tuple[str, str, str]]:
        """(pod name, role, pod IP) of every running flex pod, oldest first."""
        if not self.flex_selector:
            return []
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=self.flex_selector).items
        live = [p for p in pods if p.status.phase == "Running" and p.status.pod_ip
                and p.metadata.deletion_timestamp is None]
        live.sort(key=lambda p: (p.metadata.creation_timestamp is None, p.metadata.creation_timestamp,
                                 p.metadata.name))
        out = []
        for p in live:
            role = self.registered.get(p.metadata.name) or (p.metadata.labels or {}).get(ROLE_LABEL, "")
            out.append((p.metadata.name, role, p.status.pod_ip))
        return out

    def _fixed(self, pool: str) -> int:
        return int(self.api.read_namespaced_deployment_scale(self.deployments[pool], self.namespace).spec.replicas
                   or 0)

    def replicas(self) -> dict[str, int]:
        flex = self.flex_pods()
        return {pool: self._fixed(pool) + sum(1 for _, r, _ in flex if r == pool) for pool in POOLS}

    def scale(self, pool: str, n: int) -> None:
        flex = sum(1 for _, r, _ in self.flex_pods() if r == pool)
        self.api.patch_namespaced_deployment_scale(self.deployments[pool], self.namespace,
                                                   {"spec": {"replicas": max(0, int(n) - flex)}})

    def _switch(self, src: str, dst: str) -> bool:
        """From the planner's thread: switch the newest flex pod serving `src` to `dst`; False when none did."""
        import asyncio

        import grpc

        from pdserve.services.role_cli import switch
        pods = [p for p in self.flex_pods() if p[1] == src]
        if not pods:
            return False
        name, _, ip = pods[-1]
        address = f"[{ip}]:{self.flex_port}" if ":" in ip else f"{ip}:{self.flex_port}"
        try:
            r = asyncio.run(switch(address, dst, self.drain_timeout_s))
        except grpc.RpcError as e:
            log.warning("planner: switching pod %s to %s failed: %s", name, dst, e)
            return False
        if not r.switched:
            log.warning("planner: pod %s stays %s: %s", name, r.role, r.error)
            return False
        self.registered[name] = dst
        self.core.patch_namespaced_pod(name, self.namespace, {"metadata": {"labels": {ROLE_LABEL: dst}}})
        log.info("planner: switched pod %s %s -> %s in %.2f s (drain %.2f s)", name, src, dst, r.seconds, r.drain_s)
        return True
