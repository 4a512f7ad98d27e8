"""KV block layout descriptor: two engines can exchange KV blocks only when their layouts are identical.

Also what a peer's KV region is (KVRegion) and the version of the handshake that exchanges it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

# The KV handshake's protocol (KvHandshake in worker.proto: what a region is, how blocks are addressed and how a
# READ is acknowledged). Bump it when any of that changes; workers of different versions refuse to pair.
KV_PROTOCOL_VERSION = 1

# Fields that must match for a block copied byte-for-byte to mean the same thing on the other side.
COMPAT_FIELDS = ("fingerprint", "block_size", "dtype", "num_layers", "num_kv_heads", "head_dim")


class KVLayoutMismatch(ValueError):
    """Raised when a peer's KV layout differs; the message names every mismatching field."""

    def __init__(self, mismatches: dict[str, tuple[object, object]]):
        self.mismatches = mismatches
        parts = [f"{k}: local={a!r} remote={b!r}" for k, (a, b) in mismatches.items()]
        super().__init__("KV layout mismatch between workers (" + "; ".join(parts) + ")")


@dataclass(frozen=True)
class KVLayout:
    fingerprint: str
    block_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int = 0

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
    # block_bytes follows from the others; check it too so a layout bug cannot copy a short block.
    if not mism and lo.block_bytes and re_.block_bytes and lo.block_bytes != re_.block_bytes:
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
