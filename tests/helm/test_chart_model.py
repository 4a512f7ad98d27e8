"""The model volume in the rendered chart: each `model.source` (pvc, hostPath, download, hf), and the hf init
container run for real against a local stand-in for the hub."""
from __future__ import annotations

import pytest

from tests.helm._chart import FULL, SCENARIOS, by_kind, container_env, objects, pod_template


@pytest.mark.parametrize("source,vol_key", [("pvc", "persistentVolumeClaim"), ("hostPath", "hostPath"),
                                            ("download", "emptyDir"), ("hf", "emptyDir")])
def test_model_sources(source, vol_key):
    vals = {"model": {"source": source, "subPath": "m", "pvc": {"claimName": "c"}, "hostPath": {"path": "/w"},
                      "download": {"url": "s3:b/m"}, "hf": {"repo": "org/m"}}}
    d = by_kind(objects(vals), "Deployment")
    for name in (f"{FULL}-gateway", f"{FULL}-prefill", f"{FULL}-decode"):
        spec = pod_template(d[name])
        vol = next(v for v in spec["volumes"] if v["name"] == "model")
        assert vol_key in vol
        c = spec["containers"][0]
        assert c["args"][c["args"].index("--model") + 1] == "/models/m"
        writable = source in ("download", "hf")
        assert {"name": "model", "mountPath": "/models", "readOnly": not writable} in c["volumeMounts"]
        assert ("initContainers" in spec) == writable
    # builtin: no volume, no init container (router never needs the model)
    d = by_kind(objects(), "Deployment")
    for name, dep in d.items():
        spec = pod_template(dep)
        assert "initContainers" not in spec and all(v["name"] != "model" for v in spec.get("volumes", []))


def test_hf_init_container_downloads_the_snapshot(tmp_path):
    """The rendered init container's command, run here with its rendered env and the real huggingface_hub against a
    local stand-in for the hub (`HF_ENDPOINT`, which an operator sets through `model.hf.env` for a mirror): it
    fetches the files `allowPatterns` selects into the directory `--model` names, with the token from the Secret;
    a second run on the filled volume (a reused cache claim) lists the repo but downloads nothing; a repo the hub
    does not have fails the init container (non-zero), so the pod never starts without its model."""
    import os
    import subprocess
    import sys

    from tests.helm._fakehub import FakeHub

    d = by_kind(objects(SCENARIOS["extras_hf_podmonitor"]), "Deployment")
    spec = pod_template(d[f"{FULL}-decode"])
    [init] = spec["initContainers"]
    c = spec["containers"][0]
    model_dir = c["args"][c["args"].index("--model") + 1]
    assert model_dir == "/models/Qwen/Qwen2.5-0.5B-Instruct"
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
    assert next(v for v in spec["volumes"] if v["name"] == "model")["persistentVolumeClaim"] == {"claimName": "hf"}
    tok = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert tok["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    env = container_env(init)
    assert env["HF_REPO"] == "Qwen/Qwen2.5-0.5B-Instruct" and env["HF_REVISION"] == "main"
    assert env["MODEL_DIR"] == model_dir and env["HF_TOKEN"] == "secret:hf-token/token"
    assert init["command"][0] == "python"  # the image's venv python
    # container paths -> local ones; the Secret's value -> a token
    local = tmp_path / "models" / "Qwen" / "Qwen2.5-0.5B-Instruct"
    env.update(MODEL_DIR=str(local), HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "home" / "hf"),
               HF_TOKEN="hf_from_secret", PATH=os.environ["PATH"])
    env.pop("TORCH_EXTENSIONS_DIR")
    files = {"config.json": b'{"model_type": "llama"}', "tokenizer.json": b"{}",
             "model.safetensors": b"w" * 4096, "pytorch_model.bin": b"dup", "README.md": b"# card"}
    with FakeHub("Qwen/Qwen2.5-0.5B-Instruct", files) as hub:
        env["HF_ENDPOINT"] = hub.endpoint

        def run():
            return subprocess.run([sys.executable, *init["command"][1:]], env=env, capture_output=True, text=True,
                                  timeout=60)
        r = run()
        assert r.returncode == 0 and f"model ready in {local}" in r.stdout, r.stderr[-2000:]
        got = {p.name: p.read_bytes() for p in local.iterdir() if p.is_file()}
        assert got == {k: files[k] for k in ("config.json", "tokenizer.json", "model.safetensors")}
        repo_calls = [q for q in hub.requests if "Qwen" in q[1]]
        assert repo_calls and all(a == "Bearer hf_from_secret" for _, _, a in repo_calls)
        assert sum(m == "GET" and "/resolve/" in p for m, p, _ in repo_calls) == 3
        hub.requests.clear()
        r = run()
        assert r.returncode == 0, r.stderr[-2000:]
        assert not [q for q in hub.requests if q[0] == "GET" and "/resolve/" in q[1]], hub.requests
        env.update(HF_REPO="Qwen/missing", MODEL_DIR=str(tmp_path / "other"))
        r = run()
        assert r.returncode != 0 and not (tmp_path / "other" / "config.json").exists()
