"""Scale the prefill and decode Deployments through the Kubernetes API (the official `kubernetes` client).

Exactly two calls, on the `scale` subresource of the two Deployments the chart names
(`<release>-pdserve-prefill`, `<release>-pdserve-decode`): GET (`read_namespaced_deployment_scale`) and PATCH
(`patch_namespaced_deployment_scale`, body `{"spec": {"replicas": n}}`). The chart's Role grants `get` and `patch`
on `deployments/scale` for those two names and nothing else (helm/pdserve/templates/planner.yaml). Removing a pod
is Kubernetes' choice of pod; its SIGTERM drains it (the worker leaves the registry, finishes its requests, within
terminationGracePeriodSeconds: docs/helm.md). Credentials: in a pod, the ServiceAccount (in-cluster config);
elsewhere a kubeconfig (--kubeconfig, else $KUBECONFIG / ~/.kube/config).
"""
from __future__ import annotations

import os

from pdserve.planner.connectors import POOLS


class KubernetesConnector:
    name = "kubernetes"

    def __init__(self, namespace: str, deployments: dict[str, str], kubeconfig: str | None = None,
                 context: str | None = None):
        from kubernetes import client, config
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            config.load_kube_config(config_file=kubeconfig, context=context)
        self.api = client.AppsV1Api()
        self.namespace = namespace
        self.deployments = deployments  # pool -> Deployment name

    def replicas(self) -> dict[str, int]:
        out = {}
        for pool in POOLS:
            s = self.api.read_namespaced_deployment_scale(self.deployments[pool], self.namespace)
            out[pool] = int(s.spec.replicas or 0)
        return out

    def scale(self, pool: str, n: int) -> None:
        self.api.patch_namespaced_deployment_scale(self.deployments[pool], self.namespace,
                                                   {"spec": {"replicas": int(n)}})
