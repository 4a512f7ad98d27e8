"""lm-eval 0.4.13 itself, run as its users run it, against `pdserve up --model builtin`:

    lm_eval --model local-completions --model_args model=builtin,base_url=<gateway>/v1/completions ...

with no tokenizer named, offline (the hub unreachable), so its default `tokenizer_backend="auto"` must find the
server's tokenizer endpoints. Two local-file tasks over the built-in model's held-out fortunes (never trained
on): a multiple-choice task (log-likelihood requests: token ids, `echo`, `logprobs`) and a greedy
`generate_until` task. lm-eval's logged per-sample results are checked against transformers on the same
weights, not against the server's own answers.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.builtin import builtin_model_dir

lm_eval = pytest.importorskip("lm_eval")

N_DOCS = 12
# The server computes the bf16 checkpoint in bf16, the reference in float32: a continuation's summed
# log-likelihood may move by a few hundredths per token; a wrong token, offset or missing echo moves it by units.
LL_TOL_PER_TOKEN = 0.08


def _fortunes() -> list[str]:
    """The held-out records' first lines that are long enough to split into a context and an ending."""
    text = (builtin_model_dir() / "heldout.txt").read_text()
    lines = [rec.strip().split("\n")[1].strip() for rec in text.split("\n%\n")[1:] if rec.strip().count("\n")]
    return [ln for ln in lines if len(ln.split()) >= 8]


def _write_tasks(root: Path) -> None:
    lines = _fortunes()[: N_DOCS + 3]
    rng = random.Random(0)
    mc, gen = [], []
    for i, line in enumerate(lines[:N_DOCS]):
        words = line.split()
        cut = len(words) // 2
        ending = " ".join(words[cut:])  # lm-eval puts its target_delimiter (" ") between context and choice
        others = [" ".join(o.split()[len(o.split()) // 2:]) for o in rng.sample(lines[:i] + lines[i + 1:], 2)]
        choices = [ending, *others]
        rng.shuffle(choices)
        mc.append({"context": " ".join(words[:cut]), "choices": choices, "label": choices.index(ending)})
        gen.append({"context": " ".join(words[:cut]), "ending": " " + ending})
    for name, docs in (("mc", mc), ("gen", gen)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ntest_split: test\n"
    (root / "fortunes_mc.yaml").write_text(
        f"task: fortunes_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n")
    (root / "fortunes_gen.yaml").write_text(
        f"task: fortunes_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{ending}}'\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n")


_RUN: dict = {}


@pytest.fixture
def lm_eval_run(colocated_builtin, tmp_path_factory):
    """One `lm_eval` command over both tasks against the shared built-in deployment (tests/e2e/conftest.py), run
    once for the module; its per-sample logs."""
    if "run" not in _RUN:
        _RUN["run"] = _run_lm_eval(colocated_builtin.base_url, tmp_path_factory.mktemp("lm_eval"))
    return _RUN["run"]


def _run_lm_eval(base_url: str, root: Path):
    _write_tasks(root)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(root / "hf_cache"), OPENAI_API_KEY="unused")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", f"model=builtin,base_url={base_url}/v1/completions,num_concurrent=2,max_retries=1",
           "--tasks", "fortunes_mc,fortunes_gen", "--include_path", str(root),
           "--output_path", str(root / "out"), "--log_samples"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = {}
    for path in (root / "out").rglob("samples_*.jsonl"):
        task = path.name.split("_", 1)[1].rsplit("_", 1)[0]
        logs[task] = [json.loads(line) for line in path.read_text().splitlines()]
    results = json.loads(next((root / "out").rglob("results_*.json")).read_text())["results"]
    return proc, logs, results


@pytest.fixture(scope="module")
def reference():
    import torch
    import transformers as tf
    path = builtin_model_dir()
    tok = tf.AutoTokenizer.from_pretrained(path)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tok, model  # computed on one intra-op thread (tests/conftest.py)


def _ref_loglikelihood(tok, model, context: str, cont: str) -> tuple[float, int]:
    import torch
    # lm-eval's encoding of a causal model's pair (its api/model.py `_encode_pair`): the whole text and the
    # context, without special tokens; the continuation is what the whole adds past the context's length.
    ctx = tok(context, add_special_tokens=False).input_ids
    con = tok(context + cont, add_special_tokens=False).input_ids[len(ctx):]
    ids = torch.tensor([ctx + con])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    return float(sum(logp[len(ctx) + i - 1, t] for i, t in enumerate(con))), len(con)


def test_lm_eval_found_the_server_tokenizer_offline(lm_eval_run):
    proc, logs, results = lm_eval_run
    assert "remote tokenizer" in (proc.stderr + proc.stdout).lower()
    assert set(logs) == {"fortunes_mc", "fortunes_gen"} and all(len(v) == N_DOCS for v in logs.values())


def test_multiple_choice_loglikelihoods_match_transformers(lm_eval_run, reference):
    _, logs, results = lm_eval_run
    tok, model = reference
    correct = 0
    for sample in logs["fortunes_mc"]:
        doc = sample["doc"]
        served = [float(r[0][0]) for r in sample["resps"]]
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]  # the strings lm-eval scored
        assert [cont for _, cont in pairs] == [" " + c for c in doc["choices"]]
        want = [_ref_loglikelihood(tok, model, ctx, cont) for ctx, cont in pairs]
        for got, (ref, n) in zip(served, want):
            assert abs(got - ref) <= LL_TOL_PER_TOKEN * n, (doc, served, want)
        correct += max(range(len(want)), key=lambda i: want[i][0]) == doc["label"]
    print(f"lm-eval acc {results['fortunes_mc']['acc,none']:.3f}, transformers' choices {correct}/{N_DOCS}")
    assert results["fortunes_mc"]["acc,none"] == pytest.approx(correct / N_DOCS)
    assert correct / N_DOCS > 1 / 3  # the model read the held-out text better than chance


def test_greedy_generation_matches_transformers(lm_eval_run, reference):
    import torch
    _, logs, _ = lm_eval_run
    tok, model = reference
    exact, nonempty = 0, 0
    for sample in logs["fortunes_gen"]:
        ids = tok(sample["doc"]["context"], add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        want = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0]
        got = sample["resps"][0][0]
        exact += got == want
        nonempty += bool(want)
        # bf16 against float32 may part ways at a near tie, never at the first token
        assert got[:4] == want[:4], (got, want)
    print(f"greedy continuations equal to transformers': {exact}/{N_DOCS}")
    assert exact >= N_DOCS - 2 and nonempty >= N_DOCS // 2  # and the model did not just stop at once
