"""Rank 0's KV pool under tensor parallelism: block copies and swaps run here and are recorded, in order, for
the other ranks to replay from the next step plan before its forward (their pools hold the other heads of the
same block ids, and only a forward reads or writes them)."""
from __future__ import annotations

from pdserve.engine.kv_cache import KVCache
from pdserve.engine.tp.plan import KvOp


class RecordingKVCache(KVCache):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ops: list[KvOp] = []

    def take_ops(self) -> list[KvOp]:
        ops, self.ops = self.ops, []
        return ops

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        super().copy_blocks(pairs)
        if pairs:
            self.ops.append(KvOp("copy", list(pairs)))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        super().swap_out(pairs)
        if pairs:
            self.ops.append(KvOp("swap_out", list(pairs)))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        super().swap_in(pairs)
        if pairs:
            self.ops.append(KvOp("swap_in", list(pairs)))
