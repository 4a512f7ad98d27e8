"""Shared fixtures: tiny random Llama-family checkpoints written with `transformers` (the independent reference)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the CUDA path's Triton kernels run under Triton's interpreter (tests/engine/test_triton_*.py).
# It has to be chosen before triton is first imported: triton.language's own helpers are jitted at import.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread in the pytest process, whatever is collected. tests/engine/test_sampler.py set it at import,
# so a whole-suite run already had it while `pytest tests/e2e` did not: there, two threads waiting on each other
# beside a busy core made one 12-token transformers generate of the built-in model take 28 s instead of 1.35 s.
# Worker processes choose their own (--threads).
torch.set_num_threads(1)

# Workers of the tests' deployments start their grammar compiler processes at the first constrained request:
# ~3 s of CPU each, two per worker, which most deployments here never use (tests/engine/test_grammar_pool.py and
# test_hostile_neighbour start them both ways). Children inherit it; a test may set it otherwise.
os.environ.setdefault("PDSERVE_GRAMMAR_START", "lazy")

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every jolly "
         "vexing sphinx of black quartz judge my vow and pack my box with five dozen liquor jugs").split()


def make_tokenizer(out: Path, vocab_size: int = 96) -> None:
    """A byte-level BPE trained on pangrams; special tokens <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))]
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}"}))


def make_checkpoint(out: Path, arch: str = "llama", *, vocab_size: int = 320, hidden: int = 64, layers: int = 2,
                    heads: int = 4, kv_heads: int = 2, tie: bool = False, rope_scaling: dict | None = None,
                    dtype: torch.dtype = torch.float32, seed: int = 0, max_pos: int = 512,
                    sharded: bool = False, sliding_window: int | None = None, **arch_fields) -> Path:
    """`arch_fields`: more fields of the architecture's transformers config (head_dim, num_experts, ...)."""
    import transformers as tf

    out.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2 + 8,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_pos, tie_word_embeddings=tie, bos_token_id=0, eos_token_id=1,
                  rms_norm_eps=1e-5)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_scaling=rope_scaling)
        cls = tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=sliding_window)
        cls = tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, **arch_fields)
        cls = tf.Qwen3ForCausalLM
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, **{"num_experts": 4, "num_experts_per_tok": 2,
                                             "moe_intermediate_size": hidden + 8, **arch_fields})
        cls = tf.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        cfg = tf.MixtralConfig(**common, **{"num_local_experts": 4, "num_experts_per_tok": 2,
                                            "sliding_window": sliding_window, **arch_fields})
        cls = tf.MixtralForCausalLM
    elif arch == "gpt_oss":
        # YaRN over a short original context so that positions of the tests' prompts are really rescaled
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        cfg = tf.GptOssConfig(**common, **{"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                           "sliding_window": sliding_window or 6, "rope_parameters": rope,
                                           # gpt-oss clamps at 7; this small model's gates rarely reach it
                                           "swiglu_limit": 0.6,
                                           **arch_fields})
        cls = tf.GptOssForCausalLM
    elif arch == "phi3":
        cfg = tf.Phi3Config(**common, sliding_window=sliding_window, pad_token_id=0, **arch_fields)
        cls = tf.Phi3ForCausalLM
    elif arch == "deepseek_v3":
        # MLA (q through its own low rank, a latent of 32 + 16 rope dims, values of 24), layer 0 dense, the rest
        # 8 routed experts in 4 groups (best 2 groups, top 2 experts) plus one shared expert
        cfg = tf.DeepseekV3Config(**{**common, "num_key_value_heads": heads}, **{
            "moe_intermediate_size": 24, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "kv_lora_rank": 32, "q_lora_rank": 48,
            "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 24, **arch_fields})
        cls = tf.DeepseekV3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    with torch.no_grad():  # random init is near-uniform; scale up so greedy choices are decisive
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # transformers holds an MoE layer's experts as one [experts, out, in] tensor
                p.normal_(0, 0.08)
            elif arch == "gpt_oss" and not name.endswith("norm.weight"):  # biases and sinks init to 0: exercise them
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's router correction, zeros at init
                b.normal_(0, 0.3)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="100KB" if sharded else "10GB")
    make_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built():
    """Compile the engine's native kernels once, before any test starts worker processes (each would otherwise
    wait on the build inside its start-up and could miss a readiness deadline)."""
    from pdserve.engine.kernels import native_ops
    native_ops()


# Markers by where a test lives: `-m "not e2e"` skips the deployments (`pdserve up` in processes), `-m unit` runs
# what needs no chart and no deployment (some unit tests still start a worker process or Redis of their own). A
# module outside tests/e2e that starts a whole deployment says so itself (`pytestmark = pytest.mark.e2e`).
_MARKERS = {"e2e": "e2e", "helm": "helm"}
# `slow`: the modules outside tests/e2e that took >= ~9 s each (`--durations`, 2-core Xeon): worker processes,
# tensor-parallel ranks, compiles, simulated clusters. `-m "not e2e and not slow"` is the fast loop (README).
SLOW = {
    "tests/engine/test_tp.py", "tests/engine/test_expert_dispatch.py", "tests/engine/test_grammar_pool.py", "tests/engine/test_triton_compile.py",
    "tests/engine/test_kernel_build.py", "tests/services/worker/test_disagg_tp.py",
    "tests/services/worker/test_layout.py", "tests/services/worker/test_kv_handshake.py",
    "tests/services/worker/test_lifecycle.py", "tests/services/worker/test_heartbeat.py",
    "tests/services/worker/test_prefill_restart.py", "tests/services/router/test_routing.py",
    "tests/services/worker/test_kv_pair_metrics.py",
    "tests/services/test_redis_conn.py", "tests/services/test_supervisor.py", "tests/kv_transfer/test_tp_transfer.py",
    "tests/kv_transfer/test_kv_transfer.py", "tests/sim/test_cluster.py", "tests/sim/test_validate.py",
    "tests/planner/test_policy_sim.py", "tests/sim/test_switch_control.py", "tests/bench/test_cli_mock.py",
    "tests/bench/test_coordinated_omission.py",
    # >= ~25 s each on the 2-core box at load average 14-20 (docs/testing.md, "Where the time goes")
    "tests/sim/test_real_scheduler.py", "tests/sim/test_report.py", "tests/bench/test_host_overhead.py",
    "tests/bench/test_gpu_check.py", "tests/services/gateway/test_big_answers.py",
    "tests/services/gateway/test_fields.py", "tests/services/gateway/test_hostile.py",
    "tests/planner/test_planner_process.py", "tests/planner/test_status.py", "tests/services/test_cli.py",
    "tests/services/test_internal_security.py",
}


# `alone`: the deployments whose assertions are latency or throughput bounds (rejections within 100 ms, goodput at
# 3x capacity, the planner's model against observed p90s, a shaped link's rate...): what a deployment promises with
# the machine to itself. scripts/test.sh runs them one at a time after everything else, which shares the cores.
ALONE = {
    "tests/e2e/test_overload.py", "tests/e2e/test_deadline_admission.py", "tests/e2e/test_migration.py",
    "tests/e2e/test_planner.py", "tests/e2e/test_planner_model.py", "tests/e2e/test_planner_switch.py",
    "tests/e2e/test_hostile_neighbour.py", "tests/e2e/test_lab.py", "tests/e2e/test_slow_reader.py",
    "tests/bench/test_pdserve_real.py", "tests/sim/test_validate_up.py", "tests/sim/test_validate.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = item.path.relative_to(config.rootpath)
        parts = rel.parts
        mark = _MARKERS.get(parts[1] if len(parts) > 2 else "", "unit")
        if not (mark == "unit" and item.get_closest_marker("e2e")):
            item.add_marker(getattr(pytest.mark, mark))
        if rel.as_posix() in SLOW:
            item.add_marker(pytest.mark.slow)
        if rel.as_posix() in ALONE:
            item.add_marker(pytest.mark.alone)
