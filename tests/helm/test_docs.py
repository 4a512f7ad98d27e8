"""Generated chart files are current (README values table, Grafana dashboard) and the Dockerfiles install the
project the README way: torch first (a CUDA build for the GPU image, the CPU wheel for the CPU one), then `pip
install .`."""
from __future__ import annotations

import importlib.util
import json
import re

from tests.helm._chart import CHART, ROOT


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, CHART / "hack" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_values_table_is_current():
    gen = _load("gen_readme")
    readme = (CHART / "README.md").read_text()
    assert gen.render(readme) == readme, "run: python helm/pdserve/hack/gen_readme.py"
    documented = {r[0] for r in gen.rows((CHART / "values.yaml").read_text())}
    # the chart's main switches are documented
    for key in ("mode", "model.source", "redis.enabled", "redis.external.existingSecret", "autoscaling.provider",
                "workers.rdma.resources", "workers.shm.enabled", "prefill.autoscaling.targets.queueDepth",
                "decode.autoscaling.targets.kvUsageRatio", "metrics.serviceMonitor.enabled",
                "networkPolicy.enabled", "gateway.apiKeys.enabled"):
        assert key in documented, key


def test_dashboard_json_is_current():
    gen = _load("gen_dashboard")
    assert json.loads((CHART / "dashboards" / "pdserve.json").read_text()) == gen.build(), \
        "run: python helm/pdserve/hack/gen_dashboard.py"


def _runs(dockerfile: str) -> list[str]:
    text = (ROOT / "docker" / dockerfile).read_text().replace("\\\n", " ")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_dockerfiles_install_torch_first_then_project():
    for name, cuda in (("Dockerfile", True), ("Dockerfile.cpu", False)):
        lines = _runs(name)
        text = "\n".join(lines)
        torch_at = next(i for i, ln in enumerate(lines) if 'pip install "torch==${TORCH_VERSION}"' in ln)
        proj_at = next(i for i, ln in enumerate(lines) if re.search(r"pip install \.( |$|&)", ln))
        assert torch_at < proj_at, name
        assert "ARG TORCH_VERSION=2.13.0" in text  # the pin scripts/install.sh uses
        assert ("assert torch.version.cuda" in text) == cuda and ("assert not torch.version.cuda" in text) == (not cuda)
        assert ("whl/cpu" in text) == (not cuda), name  # the CUDA image must not take the CPU wheel
        assert lines[0].startswith("ARG") and "FROM" in text
        assert 'ENTRYPOINT ["pdserve"]' in text
        if cuda:
            assert re.search(r"FROM \$\{CUDA_IMAGE\}", text) and "nvidia/cuda:12" in text  # nixl-cu12 wants CUDA 12
    assert "torch==2.13.0" in (ROOT / "scripts" / "install.sh").read_text()
