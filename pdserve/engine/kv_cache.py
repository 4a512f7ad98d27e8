"""The preallocated KV pool on the device and the host swap pool, with the block layout peers must agree on."""
from __future__ import annotations

import torch

from pdserve.engine.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str,
                 num_cpu_blocks: int, fingerprint: str, num_kv_heads: int | None = None, shard=None,
                 kv_cache_dtype: str = "auto"):
        """`num_kv_heads`: the heads this pool holds (a TP rank's share, tp/shard.py); default all of them.
        `shard` (tp/shard.TPShard): which rank and heads, for the layout KV transfer peers read.
        `kv_cache_dtype`: the --kv-cache-dtype that chose `dtype` (kv_quant.py), told to peers in the layout."""
        self.num_kv_heads = num_kv_heads or (shard.num_kv_heads if shard is not None else cfg.num_kv_heads)
        self.shard = shard
        shape = (cfg.num_layers, 2, block_size, self.num_kv_heads, cfg.head_dim)
        self.data = torch.zeros((num_blocks, *shape), dtype=dtype, device=device)
        pin = device != "cpu" and torch.cuda.is_available()
        self.host = torch.zeros((num_cpu_blocks, *shape), dtype=dtype, pin_memory=pin) if num_cpu_blocks else None
        self.cfg = cfg
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.kv_cache_dtype = kv_cache_dtype

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def block_bytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def layout(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "block_size": self.block_size,
            "dtype": str(self.data.dtype).removeprefix("torch."),
            "num_layers": self.cfg.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.cfg.head_dim,
            "block_bytes": self.block_bytes,
            "tp_size": self.shard.size if self.shard is not None else 1,
            "tp_rank": self.shard.rank if self.shard is not None else 0,
            "kv_head_start": self.shard.kv_heads.start if self.shard is not None else 0,
            "total_kv_heads": self.cfg.num_kv_heads,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_kind": self.cfg.kv_layout,
        }

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token holds in this pool, all layers (an MLA model: its latents)."""
        return self.block_bytes // self.block_size

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Device-to-device block copies (copy-on-write of a shared tail)."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.data.device)
            dst = torch.tensor([d for _, d in pairs], device=self.data.device)
            self.data[dst] = self.data[src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs: device -> host."""
        for d, h in pairs:
            self.host[h].copy_(self.data[d])

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs: host -> device."""
        for h, d in pairs:
            self.data[d].copy_(self.host[h])
