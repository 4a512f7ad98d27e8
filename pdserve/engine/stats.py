"""The engine's state at one moment, as the worker publishes it (load reports, gauges, `GetStats`): one frozen
value, built on the engine thread and read from any other without a lock."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from pdserve.engine.kv_offload import TierStats
from pdserve.engine.spec_decode.decoder import SpecStats

_EMPTY: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class EngineStats:
    kv_blocks_in_use: int = 0
    kv_blocks_total: int = 0
    kv_blocks_cached_free: int = 0  # free but still holding a cached prefix (evictable)
    kv_blocks_pinned: int = 0  # prefilled, held for a decode worker's READ
    kv_logical_slots: int = 0  # tokens computed by live sequences
    kv_allocated_slots: int = 0  # slots of the blocks in use (the difference is internal fragmentation)
    cpu_blocks_in_use: int = 0  # the swap pool (preemption by swap)
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    states: Mapping[str, int] = field(default_factory=lambda: _EMPTY)  # live sequences per RequestState name
    prefix_hit_ratio: float = 0.0
    prefix_queried_tokens: int = 0  # lifetime
    prefix_hit_tokens: int = 0  # lifetime, every tier
    preemptions: Mapping[str, int] = field(default_factory=lambda: _EMPTY)  # lifetime, by mode
    terminal: Mapping[str, int] = field(default_factory=lambda: _EMPTY)  # lifetime requests per terminal state
    tier: TierStats | None = None  # the host / disk KV tier, when configured
    spec: SpecStats | None = None  # speculative decoding (a copy), when configured
    # MoE models: tokens routed to each expert since start, one row per MoE layer (LlamaModel.expert_tokens)
    expert_tokens: list[list[int]] | None = None
