"""KV block layout descriptor: two engines can exchange KV blocks when their layouts agree on the model.

Under tensor parallelism every rank has its own pool holding a slice of the KV heads (engine/tp/shard.py); the
layout says which (tp_size, tp_rank, kv_head_start, num_kv_heads of total_kv_heads), so pools of workers at
different TP degrees still exchange blocks, head slice by head slice (tp_pull.py).

Also what a peer's KV region is (KVRegion) and the version of the handshake that exchanges it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# The KV handshake's protocol (KvHandshake in worker.proto: what a region is, how blocks are addressed and how a
# READ is acknowledged). Bump it when any of that changes; workers of different versions refuse to pair.
# 2: a peer may be tensor parallel (one region per rank in KvHandshakeResponse.tp_regions, head ranges in the
# layout), and a READ's notification no longer releases a lease whose KV needed more than one READ.
KV_PROTOCOL_VERSION = 2

# Fields that must match for a head's KV copied byte-for-byte to mean the same thing on the other side (the
# head count is the model's, total_kv_heads; each pool's own share may differ between TP degrees).
COMPAT_FIELDS = ("kv_kind", "kv_cache_dtype", "fingerprint", "block_size", "dtype", "num_layers", "total_kv_heads",
                 "head_dim")
KV_KINDS = {"mha": "per-head K and V", "mla": "one compressed latent per token (multi-head latent attention)"}


class KVLayoutMismatch(ValueError):
    """Raised when a peer's KV layout differs; the message names every mismatching field."""

    def __init__(self, mismatches: dict[str, tuple[object, object]]):
        self.mismatches = mismatches
        parts = [f"{k}: local={a!r} remote={b!r}" for k, (a, b) in mismatches.items()]
        if "kv_kind" in mismatches:  # the two pools do not even hold the same kind of entry per token
            a, b = mismatches["kv_kind"]
            parts[0] += f" (local holds {KV_KINDS.get(a, a)}, remote {KV_KINDS.get(b, b)})"
        hint = "; start prefill and decode workers with the same --kv-cache-dtype" if "kv_cache_dtype" in mismatches \
            else ""
        super().__init__("KV layout mismatch between workers (" + "; ".join(parts) + ")" + hint)


@dataclass(frozen=True)
class KVLayout:
    fingerprint: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int  # num_kv_heads: the heads in THIS pool (a TP rank's share)
    block_bytes: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    kv_head_start: int = 0
    total_kv_heads: int = 0  # the model's KV heads; 0 (a layout from before TP) = num_kv_heads
    # --kv-cache-dtype (engine/kv_quant.py): how the K/V values were stored; "" (a peer from before) = "auto"
    kv_cache_dtype: str = "auto"
    kv_kind: str = "mha"  # KV_KINDS; "" (a peer from before the field) = "mha"

    def __post_init__(self):  # proto3 zeros (a peer from before TP) mean "no tensor parallelism"
        if not self.kv_kind:
            object.__setattr__(self, "kv_kind", "mha")
        if not self.tp_size:
            object.__setattr__(self, "tp_size", 1)
        if not self.total_kv_heads:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if not self.kv_cache_dtype:
            object.__setattr__(self, "kv_cache_dtype", "auto")

    @property
    def heads(self) -> range:
        """The model's KV heads this pool holds."""
        return range(self.kv_head_start, self.kv_head_start + self.num_kv_heads)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's KV (one of K/V, one layer) for all heads of this pool: the pool is
        [block][layer][K/V][token][head][head_dim], so a head range is contiguous only within such a row."""
        return self.block_bytes // (self.num_layers * 2 * self.block_size) if self.block_bytes else 0

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["dtype"] = str(kw.get("dtype", "")).removeprefix("torch.")  # torch.float16 and float16 are one dtype
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)


def check_compatible(local: KVLayout | dict, remote: KVLayout | dict) -> None:
    """Raise KVLayoutMismatch naming each field (fingerprint, block_size, dtype, ...) that differs."""
    lo = local if isinstance(local, KVLayout) else KVLayout.from_dict(local)
    re_ = remote if isinstance(remote, KVLayout) else KVLayout.from_dict(remote)
    mism = {k: (getattr(lo, k), getattr(re_, k)) for k in COMPAT_FIELDS if getattr(lo, k) != getattr(re_, k)}
    if "total_kv_heads" in mism and lo.tp_size == re_.tp_size == 1:
        mism["num_kv_heads"] = mism.pop("total_kv_heads")  # both unsharded: name the field they both send
    # block_bytes follows from the others; check it too so a layout bug cannot copy a short block.
    if not mism and lo.block_bytes and re_.block_bytes and \
            lo.block_bytes * re_.num_kv_heads != re_.block_bytes * lo.num_kv_heads:
        mism["block_bytes"] = (lo.block_bytes, re_.block_bytes)
    if mism:
        raise KVLayoutMismatch(mism)


@dataclass(frozen=True)
class KVRegion:
    """What a peer needs to address our blocks: sent once per peer pair, in the KV handshake."""

    agent_name: str
    agent_metadata: bytes
    base_addr: int
    num_blocks: int
    device_id: int
    mem_type: str
    layout: KVLayout
