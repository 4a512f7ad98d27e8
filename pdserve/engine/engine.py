"""The engine every worker role shares: one object that adds requests, steps the scheduler, streams outputs and
reclaims once. Its parts, one concept per file: engine_admit.py (a request in), engine_step.py (the step),
engine_reclaim.py (deadlines, backpressure, the one idempotent reclaim), engine_disagg.py (the disaggregation
hooks), engine_load.py (what services read of its load); this file builds it and holds its state.
"""
from __future__ import annotations

import itertools
import logging
from collections import deque
from pathlib import Path

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.checkpoint import resolve_model_dir
from pdserve.engine.config import DTYPES, EngineConfig, ModelConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.cpu_isa import EngineInfo, choose_dtype, detected_level
from pdserve.engine.engine_admit import EngineAdmit
from pdserve.engine.engine_disagg import EngineDisagg
from pdserve.engine.engine_load import EngineLoad
from pdserve.engine.engine_reclaim import EngineReclaim
from pdserve.engine.engine_step import EngineStep
from pdserve.engine.kernels import native_ops
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_offload import KVOffload
from pdserve.engine.kv_quant import storage_dtype as kv_storage_dtype
from pdserve.engine.kv_sizing import CPU_DEFAULT_KV_BYTES, block_bytes_for, swap_blocks
from pdserve.engine.kv_sizing import num_blocks as kv_pool_blocks
from pdserve.engine.loader import load_state_dict
from pdserve.engine.model import LlamaModel
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import CompletionOutput, FirstToken, RequestOutput, UsageRecord
from pdserve.engine.quant import auto_weight_storage, keep_batch1_gemv, weights_label
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.spec_decode import make_spec_decoder
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.tp.dispatch import uses_all_to_all
from pdserve.engine.tp.kv_ops import RecordingKVCache
from pdserve.engine.tp.shard import shard_for

log = logging.getLogger("pdserve.engine")

__all__ = ["Engine", "EngineConfig", "RequestOutput", "CompletionOutput", "FirstToken"]

# Usage records kept in memory (the latest ones, for tests and tools; the usage log has them all): a long-running
# worker must not grow a list forever.
USAGE_RECORDS_KEPT = 1024


def auto_dtype(checkpoint_dtype: torch.dtype, device: str) -> torch.dtype:
    """`dtype=auto`: what is fastest on this device for this checkpoint (cpu_isa.choose_dtype)."""
    return choose_dtype(detected_level() if device.startswith("cpu") else "", checkpoint_dtype, device)


class Engine(EngineAdmit, EngineStep, EngineReclaim, EngineDisagg, EngineLoad):
    def __init__(self, model_config: ModelConfig, config: EngineConfig, model: LlamaModel, tokenizer: Tokenizer,
                 fingerprint: str):
        config.validate()
        self.model_config = model_config
        self.config = config
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.max_model_len = min(config.max_model_len or model_config.max_model_len, model_config.max_model_len)
        dtype = next(model.parameters()).dtype
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)  # the compute dtype unless quantized
        # With tensor parallelism (model.comm) each rank's pool holds its KV heads for the same block ids: the
        # sizes below are one rank's; every rank sizes its own pool the same way (on CUDA the profiling forward
        # runs on all ranks at once: it has collectives) and all take the smallest count.
        per_block = block_bytes_for(model_config.num_layers, config.block_size, model.shard.num_kv_heads,
                                    model_config.head_dim, kv_dtype)
        num_blocks = kv_pool_blocks(config, model, torch.device(config.device), per_block)
        if model.comm is not None:
            num_blocks = model.comm.min_int(num_blocks)
        # preemption by swap: the host pool, sized like the device pool per rank (every rank holds the same blocks)
        num_cpu_blocks = swap_blocks(config, per_block)
        self.kv_cache = (KVCache if model.comm is None else RecordingKVCache)(
            model_config, num_blocks, config.block_size, kv_dtype, config.device, num_cpu_blocks, fingerprint,
            num_kv_heads=model.shard.num_kv_heads, shard=model.shard, kv_cache_dtype=config.kv_cache_dtype)
        self.tp_group = None  # engine/tp/group.py: the other ranks' processes (set by from_pretrained)
        self.block_manager = BlockManager(num_blocks, config.block_size, fingerprint, config.enable_prefix_caching,
                                          num_cpu_blocks, kv=self.kv_cache)
        # Every layer windowed (sliding_window is the model-wide one; gpt-oss's full layers leave it None): a
        # sequence's blocks before its window are released as it moves on (block_manager.release_out_of_window).
        self.block_manager.window = model_config.sliding_window
        self.scheduler = Scheduler(config, self.block_manager)
        self.kv_offload = None
        if config.kv_offload_bytes:  # the host (and disk) KV tier: hooks in the block manager and scheduler
            self.kv_offload = KVOffload(self.block_manager, self.kv_cache, config.kv_offload_bytes,
                                        config.kv_offload_dir, config.kv_offload_disk_bytes)
            self.block_manager.offload = self.scheduler.recall = self.kv_offload
        self.core = EngineCore(self.scheduler, self.block_manager, self.max_model_len)  # shared with the simulator
        self.runner = ModelRunner(model, self.kv_cache, native=config.native_kernels, attention=config.attention,
                                  cuda_graph_max_batch=config.max_num_seqs if config.cuda_graphs else 0,
                                  deterministic=config.deterministic)
        model.reset_expert_tokens()  # the pool sizing's profiling forward routed no request's tokens
        self.sampler = Sampler(model_config.vocab_size, row_by_row=config.deterministic)
        self.sampler.native_ops = self.runner.native_ops
        self.info = EngineInfo(
            isa=detected_level() if self.runner.device.type == "cpu" else self.runner.device.type,
            dtype=str(dtype).removeprefix("torch."), kernels=self.runner.kernels_name(),
            checkpoint_dtype=str(model_config.checkpoint_dtype).removeprefix("torch."),
            chosen_by="auto" if config.dtype == "auto" else "--dtype",
            weights=weights_label(model.weight_storage, dtype),
            linear=("onednn+gemv" if model.gemv_bytes else "onednn") if model.packed else "torch")
        log.info("%s", self.info.line())
        self.eos_token_ids = sorted(set(model_config.eos_token_ids) | set(tokenizer.eos_token_ids))
        self.requests: dict[str, Request] = {}
        self.remote_pending: dict[str, Request] = {}
        self.usage_records: deque[UsageRecord] = deque(maxlen=USAGE_RECORDS_KEPT)
        self.terminal_counts: dict[str, int] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.batch_sizes: deque[tuple[int, int]] = deque(maxlen=4096)  # (sequences, tokens) of recent ticks
        self.spec = make_spec_decoder(self)  # speculative decoding, or None

    @classmethod
    def from_pretrained(cls, model: str | Path, config: EngineConfig | None = None) -> "Engine":
        config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_dir = resolve_model_dir(model)
        mcfg = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer(model_dir, mcfg.eos_token_ids)
        tensors, digest = load_state_dict(model_dir)
        dtype = auto_dtype(mcfg.checkpoint_dtype, config.device) if config.dtype == "auto" else DTYPES[config.dtype]
        torch.manual_seed(config.seed)
        config.validate()
        # spec D08: refused before any rank starts
        shard = shard_for(mcfg, 0, config.ranks, config.expert_parallel_size > 1, config.replicated_attention)
        group = None
        if config.ranks > 1:
            from pdserve.engine.tp.group import RankGroup
            group = RankGroup.start(model_dir, config, dtype)
        with torch.device(config.device):
            net = LlamaModel(mcfg, shard, group.comm if group else None,
                             uses_all_to_all(config.expert_dispatch, config.expert_parallel_size, mcfg.num_experts_per_tok,
                                             config.replicated_attention)).to(dtype)
        net.load_hf_weights(tensors)
        del tensors
        net.eval()
        ops = native_ops() if config.native_kernels and config.device.startswith("cpu") else None
        storage = config.quantization if config.quantization != "none" else "same"
        reserve = config.kv_cache_bytes or CPU_DEFAULT_KV_BYTES
        if storage == "same" and config.dtype == "auto" and config.ranks == 1:
            # a bf16 checkpoint computed in fp32: bf16 copies for the decode GEMVs (quant.py, docs/engine.md)
            storage = auto_weight_storage(net, detected_level(), mcfg.checkpoint_dtype, dtype, config.device,
                                          ops is not None, reserve)
        if storage != "same":
            net.store_weights(storage, ops)
        if ops is not None and config.device.startswith("cpu"):
            net.stack_experts()  # sparse layers' experts for the native MoE kernel (moe.py)
        # bf16 computed as bf16: batch-1 decode through the native GEMV beside oneDNN's packed weights (quant.py)
        net.pack_weights(storage == "same" and config.ranks == 1 and keep_batch1_gemv(
            net, detected_level(), dtype, config.device, ops is not None, reserve))
        # int8 weights compute different KV: never shared with (or prefix-hit by) an unquantized deployment's.
        quant = "" if config.quantization == "none" else ":" + config.quantization
        # so does a quantized KV pool (other bytes for the same tokens): its own prefix-cache and disk-tier keys
        quant += "" if config.kv_cache_dtype == "auto" else ":kv-" + config.kv_cache_dtype
        engine = cls(mcfg, config, net, tokenizer, mcfg.fingerprint(digest + quant, dtype))
        engine.tp_group = group
        return engine

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent; a one-process engine holds nothing)."""
        if self.tp_group is not None:
            self.tp_group.stop()

    # ---- convenience ------------------------------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams],
                 namespace: str = "") -> list[RequestOutput]:
        """Run a batch to completion and return the final output of each prompt, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            toks = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"gen-{id(prompts)}-{i}"
            self.add_request(rid, toks, p, namespace=namespace)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]
