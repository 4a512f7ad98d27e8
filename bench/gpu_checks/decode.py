"""decode-8b-b{1,64}: one decode forward (CUDA graph replay) against the HBM bound of the bytes it reads."""
from __future__ import annotations

import time

from bench.gpu_checks import harness
from bench.gpu_checks.harness import Line, Skip, copy_bandwidth, gpu_time, importable, need_cuda

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128)
TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=64)


class DecodeBench:
    """A random Llama-3-8B-shaped bf16 model with its pool, runner and graphs, built once for both batch sizes."""

    def __init__(self, max_batch: int, ctx: int):
        import torch

        from pdserve.engine.config import ModelConfig
        from pdserve.engine.kv_cache import KVCache
        from pdserve.engine.model import LlamaModel
        from pdserve.engine.model_runner import ModelRunner
        cfg = ModelConfig(architecture="LlamaForCausalLM", rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None,
                          max_position_embeddings=8192, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                          mlp_bias=False, sliding_window=None, checkpoint_dtype=torch.bfloat16,
                          **(LLAMA3_8B if harness.SHAPE == "8b" else TINY))
        self.ctx, self.cfg = ctx, cfg
        bs = 16
        per_seq = -(-(ctx + 1) // bs)
        with torch.device(harness.DEVICE):
            self.model = LlamaModel(cfg).to(torch.bfloat16)  # as Engine.from_pretrained builds it
        # bytes a decode step reads: every weight but the embedding table, of which it reads `batch` rows
        self.read_weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters()) - \
            self.model.embed.weight.numel() * self.model.embed.weight.element_size()
        self.kv = KVCache(cfg, max_batch * per_seq + 1, bs, torch.bfloat16, harness.DEVICE, 0, "gpu-check")
        self.kv.data.normal_()
        t = time.perf_counter()
        self.runner = ModelRunner(self.model, self.kv, attention="auto", cuda_graph_max_batch=max_batch)
        self.capture_s = time.perf_counter() - t
        self.per_seq = per_seq

    def step_s(self, batch: int) -> tuple[float, float, int]:
        """(graph replay s, eager s, bytes read per step) of one decode forward at `batch`."""
        import torch

        from pdserve.engine.attention import AttentionMetadata, NativeDecode
        from pdserve.engine.cuda_graphs import DecodeInputs
        bs, ctx = self.kv.block_size, self.ctx
        tables = torch.arange(batch * self.per_seq, device=harness.DEVICE).view(batch, self.per_seq)
        inputs = DecodeInputs(
            input_ids=torch.randint(0, self.cfg.vocab_size, (batch,), device=harness.DEVICE),
            positions=torch.full((batch,), ctx, device=harness.DEVICE),
            slot_blocks=tables[:, ctx // bs].contiguous(), slot_offsets=torch.full((batch,), ctx % bs, device=harness.DEVICE),
            block_tables=tables, context_lens=torch.full((batch,), ctx + 1, device=harness.DEVICE))
        graph = gpu_time(lambda: self.runner.graphs.run(inputs), reps=20) if self.runner.graphs else float("nan")
        rows = torch.arange(batch, device=harness.DEVICE)
        meta = AttentionMetadata(slot_blocks=inputs.slot_blocks, slot_offsets=inputs.slot_offsets, prefills=[],
                                 decodes=[], native_decode=NativeDecode(rows, tables, inputs.context_lens),
                                 native_ops=self.runner.attention_ops, sliding_window=None)
        eager = gpu_time(lambda: self.model(inputs.input_ids, inputs.positions, self.kv.data, meta, rows), reps=10)
        kv_bytes = batch * (ctx + 1) * self.kv.block_bytes // bs
        return graph, eager, self.read_weight_bytes + kv_bytes


def check_decode(bench_box: dict, batch: int, target: float) -> Line:
    need_cuda()
    why = importable("triton", "pdserve.engine.model_runner")
    if why:
        raise Skip(why)
    if "bench" not in bench_box:
        bench_box["bw"] = copy_bandwidth()
        bench_box["bench"] = DecodeBench(max_batch=64, ctx=1024)
    b = bench_box["bench"]
    graph, eager, nbytes = b.step_s(batch)
    bound = nbytes / bench_box["bw"]
    ratio = (graph if graph == graph else eager) / bound  # no graphs (CPU smoke run): the eager step
    n_graphs = len(b.runner.graphs.sizes) if b.runner.graphs else 0
    return Line(f"decode-{harness.SHAPE}-b{batch}",
                f"graph {graph * 1e3:.2f} ms, eager {eager * 1e3:.2f} ms, bound {bound * 1e3:.2f} ms "
                f"({nbytes / 1e9:.2f} GB at {bench_box['bw'] / 1e9:.0f} GB/s) = {ratio:.2f}x; "
                f"{n_graphs} graphs captured in {b.capture_s:.1f} s",
                f"<= {target:g}x", "PASS" if ratio <= target else "FAIL")
