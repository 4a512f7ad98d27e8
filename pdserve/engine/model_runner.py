"""Turn a scheduler tick into one forward over a flat token batch and return the logits to sample from."""
from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

from pdserve.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    NativeDecode,
    NativePrefill,
    PrefillSpan,
    causal_mask,
    decode_bias,
)
from pdserve.engine.batch_invariant import RowTiled, tile_projections
from pdserve.engine.cuda_graphs import DecodeGraphs, DecodeInputs, capture_sizes
from pdserve.engine.host_copy import to_device
from pdserve.engine.kernels import native_ops
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_quant import is_quantized
from pdserve.engine.model import LlamaModel
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.tp.plan import KvOp, StepPlan, plan_of

log = logging.getLogger(__name__)
ATTENTION_BACKENDS = ("auto", "native", "triton", "torch")


def triton_attention(device: torch.device):
    """The Triton paged-attention backend for `device`, or None (with the reason logged) where it cannot run."""
    from pdserve.engine import triton_attention as ta
    if ta.IMPORT_ERROR:
        log.warning("Triton attention unavailable, using the torch path (gather + SDPA): %s", ta.IMPORT_ERROR)
        return None
    return ta.TritonAttention.for_device(device)


def device_scope(device: torch.device):
    """Make `device` the thread's current CUDA device for the work inside: Triton launches on the current device
    and a new stream or graph capture belongs to it, whatever device their tensors are on ("cuda:1" would
    otherwise run GPU 0's kernels on GPU 1's pointers). A no-op on CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def long_tensor(values: list[int], device: torch.device | None = None) -> torch.Tensor:
    """An int64 tensor of `values` on `device`. Built through NumPy: torch.tensor over a Python list costs ~60 ns an
    element against ~15, and a step builds several of batch or chunk length (docs/engine.md, "Host overhead")."""
    t = torch.from_numpy(np.fromiter(values, np.int64, len(values)))
    return t if device is None else to_device(t, device)


def padded_tables(tables: list[list[int]], device=None) -> torch.Tensor:
    """Block tables as one int64 tensor, each padded with block 0 to the longest (the native kernels stop at each
    sequence's context length; the torch path reads the padding and masks it)."""
    width = max(map(len, tables))
    out = np.zeros((len(tables), width), dtype=np.int64)
    for row, t in zip(out, tables):  # a row slice takes a list at C speed: ~4x faster than torch.tensor(lists)
        row[:len(t)] = t
    np.maximum(out, 0, out=out)  # released entries (block_manager.HOLE, before the window): never read, block 0
    t = torch.from_numpy(out)
    return t if device is None else to_device(t, device)


class ModelRunner:
    DECODE_GROUP = 16  # decode sequences per padded attention group
    def __init__(self, model: LlamaModel, kv: KVCache, native: bool = True, attention: str = "auto",
                 cuda_graph_max_batch: int = 0, deterministic: bool = False):
        """With tensor parallelism (model.comm set) rank 0's runner broadcasts each step's plan (tp/plan.py)
        and the other ranks run `execute_plan` on what they receive."""
        """attention: auto = the compiled CPU kernels on CPU, Triton on CUDA; native / triton / torch force one
        (triton runs on CPU only under TRITON_INTERPRET=1, which is how the tests drive it).
        cuda_graph_max_batch > 0: on CUDA with the Triton kernels, decode steps up to that many sequences replay
        CUDA graphs captured here (cuda_graphs.py).
        deterministic: batch-invariant steps (batch_invariant.py): projections in fixed row tiles, every query row
        through the single-query attention, no fused decoder stack, no CUDA graphs."""
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention!r} (choose from {', '.join(ATTENTION_BACKENDS)})")
        self.model = model
        self.kv = kv
        self.comm = model.comm
        self.device = kv.data.device
        self.sliding_window = model.cfg.sliding_window
        # Norms, rope, SwiGLU and decode attention in place over the pool (kernels.py) on CPU.
        self.native_ops = native_ops() if native and self.device.type == "cpu" else None
        model.use_native_ops(self.native_ops)
        self.deterministic = deterministic
        if deterministic:
            model.stacks = None  # one fused call whose kernels follow the row count
            if not any(isinstance(m, RowTiled) for m in model.modules()):
                tile_projections(model)
        # The attention kernels that read the pool in place: the CPU module, or Triton on CUDA; None -> torch.
        use_triton = native and (attention == "triton" or (attention == "auto" and self.device.type == "cuda"))
        # Attention sinks and per-layer windows (gpt-oss) and latent attention (mla.py) have Triton kernels but no
        # compiled CPU ones: on the CPU backend they take the torch path.
        cfg = model.cfg
        triton_only = bool(cfg.attention_sinks or cfg.layer_windows or cfg.kv_layout == "mla")
        if attention == "torch" or (triton_only and not use_triton):
            self.attention_ops = None
        elif is_quantized(kv.data.dtype):
            # The compiled CPU kernels, the fused decoder stack and Triton read the pool in the compute dtype
            # only: a quantized pool goes through the torch path (gather, dequantize, SDPA / two matmuls).
            log.info("KV pool in %s: attention on the torch path (the native and Triton kernels read the "
                     "compute dtype only)", kv.data.dtype)
            self.attention_ops = None
        elif use_triton:
            self.attention_ops = triton_attention(self.device)
        else:
            self.attention_ops = self.native_ops
        if deterministic and self.attention_ops is not None and hasattr(self.attention_ops, "decode_splits_override"):
            self.attention_ops.decode_splits_override = 1  # Triton: one pass over the keys, not split by batch size
        # Prefill attention over the pool where that kernel exists (Triton; on CPU bf16 with AVX512-BF16); SDPA
        # otherwise.
        if self.attention_ops is not None and self.attention_ops is not self.native_ops:
            self.native_prefill = cfg.kv_layout != "mla"  # MLA prefill: the plain form in torch (mla.py)
        else:
            self.native_prefill = bool(self.attention_ops is not None and self.native_ops.prefill_attention_supported(
                kv.data, model.shard.num_heads))
        self.graphs: DecodeGraphs | None = None
        # (not with tensor parallelism: the captured graphs would have to hold the collectives too)
        if (cuda_graph_max_batch > 0 and self.device.type == "cuda" and self.native_prefill and self.comm is None
                and not deterministic):
            with device_scope(self.device):
                self.graphs = DecodeGraphs(model, kv.data, self.attention_ops, capture_sizes(cuda_graph_max_batch),
                                           width=-(-model.cfg.max_model_len // kv.block_size),
                                           sliding_window=self.sliding_window)

    def kernels_name(self) -> str:
        """Which kernels this runner uses: native (the compiled CPU module), triton, or torch (the fallback)."""
        if self.attention_ops is not None and self.attention_ops is not self.native_ops:
            return "triton"
        return "native" if self.native_ops is not None else "torch"

    def prepare(self, batch: list[ScheduledSeq], prompt_logits: set[int] = frozenset()):
        """Build flat inputs. Returns (input_ids, positions, metadata, logits_rows, row_owner) where row_owner[i]
        is (index into batch, absolute position) of logits row i. Sequences in `prompt_logits` (by index) get
        logits at every position of their chunk (for prompt logprobs), the others only at the last one."""
        return self.prepare_plan(plan_of(batch, prompt_logits, self.kv.block_size))

    def prepare_plan(self, plan: StepPlan):
        """`prepare` over a step plan (what every TP rank has)."""
        bs = self.kv.block_size
        ids, pos, blocks, offsets = [], [], [], []
        prefills: list[PrefillSpan] = []
        native_spans: list[tuple[int, int, int, list[int]]] = []
        decode_rows, decode_tables, decode_lens = [], [], []
        logits_rows, row_owner = [], []
        for i, item in enumerate(plan.items):
            n, first, table = len(item.tokens), item.first, item.block_table
            start = len(ids)
            if n == 1 and not item.prompt_logits:  # a decode: most items of a large batch
                ids.append(item.tokens[0])
                pos.append(first)
                blocks.append(table[first // bs])
                offsets.append(first % bs)
                decode_rows.append(start)
                decode_tables.append(table)
                decode_lens.append(first + 1)
                if item.samples:
                    logits_rows.append(start)
                    row_owner.append((i, first))
                continue
            positions = range(first, first + n)
            ids.extend(item.tokens)
            pos.extend(positions)
            blocks.extend(table[p // bs] for p in positions)
            offsets.extend(p % bs for p in positions)
            ctx = first + n
            if n == 1 and not item.prompt_logits:
                decode_rows.append(start)
                decode_tables.append(table)
                decode_lens.append(ctx)
            elif self.deterministic:  # each prompt token a single-query row over its own context (module doc)
                decode_rows.extend(range(start, start + n))
                decode_tables.extend([table] * n)
                decode_lens.extend(range(first + 1, ctx + 1))
            elif self.native_prefill:
                native_spans.append((start, n, ctx, table))
            else:
                table = torch.tensor(table, dtype=torch.long, device=self.device).clamp_(min=0)  # HOLE -> 0
                prefills.append(PrefillSpan(start, n, ctx, table, causal_mask(n, ctx, self.sliding_window,
                                                                               self.device)))
            if item.prompt_logits:
                logits_rows.extend(range(start, start + n))
                row_owner.extend((i, p) for p in positions)
            elif item.samples:
                logits_rows.append(start + n - 1)
                row_owner.append((i, first + n - 1))
        meta = self._metadata(blocks, offsets, prefills, decode_rows, decode_tables, decode_lens, native_spans)
        return (long_tensor(ids, self.device), long_tensor(pos, self.device), meta,
                long_tensor(logits_rows, self.device), row_owner)

    def _metadata(self, blocks: list[int], offsets: list[int], prefills: list[PrefillSpan], decode_rows: list[int],
                  decode_tables: list[list[int]], decode_lens: list[int],
                  native_spans: list[tuple[int, int, int, list[int]]]) -> AttentionMetadata:
        """The step's attention metadata: the slots its new K/V go to, and each kind of row in the form the
        attention path in use reads (the kernels' flat decode rows and prefill spans, or torch's groups)."""
        return AttentionMetadata(
            slot_blocks=long_tensor(blocks, self.device),
            slot_offsets=long_tensor(offsets, self.device),
            prefills=prefills,
            decodes=[] if self.attention_ops else self._decode_groups(decode_rows, decode_tables, decode_lens),
            native_decode=self._native_decode(decode_rows, decode_tables, decode_lens) if self.attention_ops else None,
            native_prefill=self._native_prefill(native_spans),
            native_ops=self.attention_ops,
            sliding_window=self.sliding_window,
        )

    def _native_prefill(self, spans: list[tuple[int, int, int, list[int]]]) -> NativePrefill | None:
        if not spans:
            return None
        dev = self.device
        return NativePrefill(
            starts=long_tensor([s[0] for s in spans], dev),
            q_lens=long_tensor([s[1] for s in spans], dev),
            context_lens=long_tensor([s[2] for s in spans], dev),
            block_tables=padded_tables([s[3] for s in spans], dev))

    def _native_decode(self, rows: list[int], tables: list[list[int]], lens: list[int]) -> NativeDecode | None:
        if not rows:
            return None
        dev = self.device
        return NativeDecode(rows=long_tensor(rows, dev), block_tables=padded_tables(tables, dev),
                            context_lens=long_tensor(lens, dev))

    def _decode_groups(self, rows: list[int], tables: list[list[int]], lens: list[int]) -> list[DecodeGroup]:
        """Decodes sorted by context length and cut into groups of similar length: each group is padded only to
        its own longest context, so a batch mixing short and long contexts does not gather (and attend over)
        every sequence at the longest length."""
        order = sorted(range(len(rows)), key=lambda k: lens[k])
        groups: list[DecodeGroup] = []
        bs = self.kv.block_size
        size = 1 if self.deterministic else self.DECODE_GROUP
        for g in range(0, len(order), size):
            idx = order[g:g + size]
            width = len(tables[idx[-1]])  # sorted: the last is the longest
            group_tables = [tables[k] for k in idx]
            if self.deterministic:  # alone, over a width its context length fixes (its table may be longer)
                width = -(-lens[idx[0]] // bs)
                group_tables = [group_tables[0][:width]]
            glens = torch.tensor([lens[k] for k in idx], dtype=torch.long, device=self.device)
            groups.append(DecodeGroup(
                rows=torch.tensor([rows[k] for k in idx], dtype=torch.long, device=self.device),
                block_tables=padded_tables(group_tables, self.device),
                bias=decode_bias(glens, width * bs, self.sliding_window), context_lens=glens))
        return groups

    def execute(self, batch: list[ScheduledSeq], prompt_logits: set[int] = frozenset()):
        with device_scope(self.device):
            return self._execute(batch, prompt_logits)

    def _execute(self, batch: list[ScheduledSeq], prompt_logits: set[int]):
        plan = plan_of(batch, prompt_logits, self.kv.block_size)
        if self.comm is not None:  # the other ranks replay rank 0's block copies/swaps, then run the same step
            plan.kv_ops = self.kv.take_ops()
            self.comm.broadcast_object(plan)
        ids, pos, meta, rows, owner = self.prepare_plan(plan)
        if (self.graphs is not None and meta.native_decode is not None and not meta.native_prefill
                and rows.numel() == ids.numel() and self.graphs.bucket(ids.numel()) is not None):
            nd = meta.native_decode  # every row a decode that samples: row i is sequence i
            return self.graphs.run(DecodeInputs(ids, pos, meta.slot_blocks, meta.slot_offsets, nd.block_tables,
                                                nd.context_lens)), owner
        logits = self.model(ids, pos, self.kv.data, meta, rows)
        return logits, owner

    def execute_plan(self, plan: StepPlan) -> None:
        """A TP rank other than 0: replay the block operations, run the forward (logits go to rank 0)."""
        with device_scope(self.device):
            for op in plan.kv_ops:
                apply_kv_op(self.kv, op)
            ids, pos, meta, rows, _ = self.prepare_plan(plan)
            self.model(ids, pos, self.kv.data, meta, rows)


def apply_kv_op(kv: KVCache, op: KvOp) -> None:
    {"copy": kv.copy_blocks, "swap_out": kv.swap_out, "swap_in": kv.swap_in}[op.kind](op.pairs)
