"""CUDA graphs for decode steps: captured at start-up for a set of batch sizes; a decode batch is padded up to the
next captured size and replayed, a larger one (or any step with a prefill) runs eagerly.

Padding repeats the batch's first decode (same token, position, KV slot, block table and context length). Its
K/V write lands in the same slot with bit-identical values, so no sink block has to be set aside in the pool and
nothing of another sequence is touched; its logits rows are dropped. The block tables are captured at the width
of the longest context the model allows: the Triton decode kernel stops at each row's own context length, so the
unused columns are never read.

The pure parts (which sizes, which bucket, the padded inputs) are functions of their own, tested on CPU
(tests/engine/test_cuda_graphs.py); the capture and replay need a GPU and run in scripts/gpu_check.sh.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.engine.attention import AttentionMetadata, NativeDecode

log = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
STEP = 8  # above 8, every multiple of 8: at most 7 padded rows per replay
MAX_CAPTURED = 512  # beyond this a decode step is long enough that launch overhead no longer matters


def capture_sizes(max_num_seqs: int, largest: int = MAX_CAPTURED) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 8, up to the smallest size covering `max_num_seqs`
    (capped at `largest`)."""
    top = min(max_num_seqs, largest)
    if top < 1:
        return []
    cover = next(s for s in SMALL_SIZES if s >= top) if top <= SMALL_SIZES[-1] else -(-top // STEP) * STEP
    return sorted({s for s in SMALL_SIZES if s < top} | set(range(STEP, top, STEP)) | {cover})


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n, or None (run eagerly) when n is 0 or larger than every captured size."""
    if n < 1:
        return None
    return next((s for s in sizes if s >= n), None)


@dataclass
class DecodeInputs:
    """One decode step's inputs, one row per sequence (row i of the flat batch is sequence i)."""
    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_blocks: torch.Tensor  # [B] int64
    slot_offsets: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, W] int64
    context_lens: torch.Tensor  # [B] int64

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]


def pad_decode(inputs: DecodeInputs, size: int, width: int) -> DecodeInputs:
    """`inputs` padded to `size` rows (copies of row 0) and its tables to `width` columns (block 0, never read)."""
    n, w = inputs.batch, inputs.block_tables.shape[1]
    if not 1 <= n <= size:
        raise ValueError(f"cannot pad a decode batch of {n} to {size}")
    if w > width:
        raise ValueError(f"block table of {w} blocks is wider than the captured {width}")
    rep = torch.arange(size, device=inputs.input_ids.device)  # made where it is used: no host copy per replay
    rep[n:] = 0
    tables = torch.zeros((size, width), dtype=torch.long, device=inputs.block_tables.device)
    tables[:, :w] = inputs.block_tables[rep]
    return DecodeInputs(inputs.input_ids[rep], inputs.positions[rep], inputs.slot_blocks[rep],
                        inputs.slot_offsets[rep], tables, inputs.context_lens[rep])


class DecodeGraphs:
    """Captured decode forwards over static input buffers; `run` copies a batch in, replays, returns its logits."""

    def __init__(self, model, kv: torch.Tensor, attention_ops, sizes: list[int], width: int,
                 sliding_window: int | None):
        self.sizes = sorted(sizes)
        self.width = width
        dev = kv.device
        top = self.sizes[-1]
        self.static = DecodeInputs(
            input_ids=torch.zeros(top, dtype=torch.long, device=dev),
            positions=torch.zeros(top, dtype=torch.long, device=dev),
            slot_blocks=torch.zeros(top, dtype=torch.long, device=dev),
            slot_offsets=torch.zeros(top, dtype=torch.long, device=dev),
            block_tables=torch.zeros((top, width), dtype=torch.long, device=dev),
            context_lens=torch.ones(top, dtype=torch.long, device=dev))
        rows = torch.arange(top, device=dev)
        # Every graph writes its logits into one buffer: each graph's own output would stay held by it, which at
        # 512 sequences and a 128k vocabulary is 8.5 GB across the 67 sizes; one buffer is top x vocab x 4 bytes
        # (kv_sizing.graph_logits_bytes reserves it), and the outputs themselves return to the shared pool.
        self.logits = torch.empty((top, model.cfg.vocab_size), dtype=torch.float32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps served by a graph (gpu_check reports it)
        pool = torch.cuda.graph_pool_handle()
        t0 = time.monotonic()
        # Captured at start-up with an empty pool: the warm-up runs write block 0 row 0, which holds nothing yet.
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            s = self.static
            meta = AttentionMetadata(
                slot_blocks=s.slot_blocks[:size], slot_offsets=s.slot_offsets[:size], prefills=[], decodes=[],
                native_decode=NativeDecode(rows[:size], s.block_tables[:size], s.context_lens[:size]),
                native_ops=attention_ops, sliding_window=sliding_window)
            args = (s.input_ids[:size], s.positions[:size], kv, meta, rows[:size])
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                model(*args)  # compiles the Triton kernels and settles allocations outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:size].copy_(model(*args))
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_s = time.monotonic() - t0
        log.info("captured %d CUDA graphs for decode batch sizes %s in %.1f s", len(self.graphs), self.sizes,
                 self.capture_s)

    def bucket(self, n: int) -> int | None:
        return bucket_for(n, self.sizes)

    def run(self, inputs: DecodeInputs) -> torch.Tensor:
        """Logits [n, vocab] of the batch's n rows (a copy: the shared logits buffer is rewritten by the next
        replay)."""
        n = inputs.batch
        size = self.bucket(n)
        padded = pad_decode(inputs, size, self.width)
        s = self.static
        for dst, src in ((s.input_ids, padded.input_ids), (s.positions, padded.positions),
                         (s.slot_blocks, padded.slot_blocks), (s.slot_offsets, padded.slot_offsets),
                         (s.block_tables, padded.block_tables), (s.context_lens, padded.context_lens)):
            dst[:size].copy_(src, non_blocking=True)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[:n].clone()
