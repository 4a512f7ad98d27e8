"""Host-memory (and optional disk) tier for prefix-cache blocks evicted from the device pool.

A cached block's KV lives in exactly one tier at a time:

    device (BlockManager.cached) --evicted--> host LRU --host full--> disk LRU (--kv-offload-dir) --full--> gone
    host / disk --prefix hit--> recall: copied into fresh device blocks --> device (cached again)

Saving happens where the device pool evicts (`BlockManager._unregister`, inside a scheduler tick, before the block
is rewritten): one block copy, ordered before the forward that reuses the block (on CUDA an async D2H copy on the
compute stream into pinned memory). Spilling host -> disk hands a copy of the block to the I/O thread.

A recall is asynchronous with the step: the scheduler asks `hold(seq)` before admitting a waiting sequence; when
its prefix chain continues in the host/disk tier, the recall pins the chain's device blocks, takes device blocks
for the rest and hands the copy to a background thread (CUDA: its own stream). The sequence stays QUEUED
(the spec's 14 states have no RECALLING; recalling is a reason to wait, like a paused one) and is skipped, so
other sequences' prefill and decode go on; `poll()` at the start of each tick registers the finished copies in
the prefix cache, and the sequence's normal lookup then hits them: none of those tokens is recomputed. The
recall's references are dropped once the sequence holds its own (`admitted`), at the end of the tick its copy
completed in (`end_of_tick`: pins never outlive that tick, so they cannot keep the queue's head from fitting), or
when it ended (`cancel`, deferred to the copy's completion), so a block being written by the background copy is
never handed to anyone else.

Hashes are the block manager's chained, fingerprint- and namespace-salted keys, kept with each entry together with
the block's token ids (a hit is verified against them, as on the device).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import numpy
import torch

from pdserve.engine.block_manager import BlockManager, KVEvent, block_hash
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.sequence import Sequence

log = logging.getLogger("pdserve.engine.kv_offload")

DEVICE, HOST, DISK = "device", "host", "disk"
DIRECTIONS = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_device")


@dataclass(frozen=True, slots=True)
class TierStats:
    """The host / disk tier at one moment (EngineStats.tier)."""
    host_blocks_in_use: int
    host_blocks_total: int
    disk_blocks_in_use: int
    disk_blocks_total: int
    recalls: int  # lifetime recalls completed
    recalls_in_flight: int
    recall_seconds: tuple[float, ...]  # the latest recalls' latencies, oldest first
    bytes_moved: Mapping[str, int]  # lifetime, by direction (DIRECTIONS)
    hit_tokens: Mapping[str, int]  # lifetime prefix-hit tokens served from each of HOST and DISK


@dataclass
class Offloaded:
    """One block's KV outside the device pool: a host slot or a file."""
    block_hash: int
    tokens: tuple[int, ...]
    namespace: str
    slot: int = -1  # host tier
    path: str = ""  # disk tier

    @property
    def tier(self) -> str:
        return HOST if self.slot >= 0 else DISK


@dataclass
class Recall:
    seq: Sequence
    pins: list[int]  # device blocks this recall holds one reference on: the chain's device hits + the targets
    targets: list[tuple[Offloaded, int]]  # (source entry, device block it is copied into)
    started: float
    future: Future | None = None
    event: object = None  # CUDA: recorded on the copy stream after the last copy
    done: bool = False
    cancelled: bool = False
    tiers: dict[str, int] = field(default_factory=dict)  # blocks recalled per source tier


def _write(path: str, data: torch.Tensor) -> None:
    data.view(torch.uint8).numpy().tofile(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class KVOffload:
    def __init__(self, bm: BlockManager, kv: KVCache, host_bytes: int, disk_dir: str | None = None,
                 disk_bytes: int | None = None):
        self.bm = bm
        self.kv = kv
        self.block_bytes = kv.block_bytes
        self.num_host_blocks = host_bytes // self.block_bytes
        if self.num_host_blocks < 1:
            raise ValueError(f"kv_offload_bytes={host_bytes} holds no KV block ({self.block_bytes} bytes each)")
        self.cuda = kv.data.device.type == "cuda"
        shape = tuple(kv.data.shape[1:])
        self.block_shape = shape
        # pinned on CUDA: async D2H/H2D copies need page-locked memory; on CPU the tier is a second, cheaper pool
        self.host = torch.empty((self.num_host_blocks, *shape), dtype=kv.data.dtype, pin_memory=self.cuda)
        self.host_free: deque[int] = deque(range(self.num_host_blocks))
        self.host_lru: OrderedDict[int, Offloaded] = OrderedDict()  # hash -> entry, least recently saved first
        self.disk_lru: OrderedDict[int, Offloaded] = OrderedDict()
        self.disk_dir = None
        self.num_disk_blocks = 0
        if disk_dir:
            os.makedirs(disk_dir, exist_ok=True)
            # a private directory per engine: files of a previous (dead) process are never mistaken for ours
            self.disk_dir = tempfile.mkdtemp(prefix="pdserve-kv-", dir=disk_dir)
            weakref.finalize(self, shutil.rmtree, self.disk_dir, True)
            self.num_disk_blocks = (disk_bytes if disk_bytes is not None else 4 * host_bytes) // self.block_bytes
        # One I/O thread: disk writes, deletes and recalls run in submission order, so a recall of a block
        # spilled a moment ago reads its file after the write, and a delete never races a later write.
        self.io = ThreadPoolExecutor(1, thread_name_prefix="kv-offload")
        weakref.finalize(self, self.io.shutdown, False)
        self.stream = torch.cuda.Stream(kv.data.device) if self.cuda else None
        self.recalls: dict[int, Recall] = {}  # seq_id -> its recall, until the sequence is admitted or ends
        self.hit_tokens = {HOST: 0, DISK: 0}
        self.bytes = {d: 0 for d in DIRECTIONS}
        self.num_recalls = 0
        self.recall_seconds: deque[float] = deque(maxlen=256)  # latest recall latencies (metrics read them)
        self.num_dropped = 0  # blocks that fell off the last tier

    # ---- the save side: a block evicted from the device pool ------------------------------------------------
    def save(self, b: int, h: int, tokens: tuple[int, ...], namespace: str) -> str | None:
        """Copy device block `b` (cached under `h`, about to be reused) into the host tier. Returns the tier that
        now holds it, or None when no host slot could be had (every slot is being recalled)."""
        slot = self._host_slot()
        if slot is None:
            self.num_dropped += 1
            return None
        # CUDA: on the compute stream, so it runs before the forward that rewrites b (no host wait here)
        self.host[slot].copy_(self.kv.data[b], non_blocking=self.cuda)
        self.host_lru[h] = Offloaded(h, tokens, namespace, slot=slot)
        self.bytes["device_to_host"] += self.block_bytes
        return HOST

    def _host_slot(self) -> int | None:
        if self.host_free:
            return self.host_free.popleft()
        if not self.host_lru:
            return None
        _, e = self.host_lru.popitem(last=False)
        slot = e.slot
        self._spill(e)
        return slot

    def _spill(self, e: Offloaded) -> None:
        """The host tier's LRU victim goes to disk (when configured and it has room after its own LRU eviction),
        else it is dropped. Either way its host slot is free when this returns."""
        if self.num_disk_blocks < 1:
            self._drop(e)
            return
        if len(self.disk_lru) >= self.num_disk_blocks:
            _, old = self.disk_lru.popitem(last=False)
            self.io.submit(_unlink, old.path)
            self._drop(old)
        if self.cuda:  # the slot may still be the target of an in-flight D2H copy
            torch.cuda.current_stream(self.kv.data.device).synchronize()
        data = self.host[e.slot].clone()  # the slot is reused at once; the file is written in the background
        e.path = os.path.join(self.disk_dir, f"{e.block_hash:016x}.kv")
        e.slot = -1
        self.io.submit(_write, e.path, data)
        self.disk_lru[e.block_hash] = e
        self.bytes["host_to_disk"] += self.block_bytes
        self.bm.events.append(KVEvent("stored", e.block_hash, e.namespace, DISK))

    def discard(self, h: int) -> None:
        """Block `h` was computed again on the device: its offloaded copy goes (a block is in one tier)."""
        e = self.host_lru.pop(h, None)
        if e is not None:
            self.host_free.append(e.slot)
            return
        e = self.disk_lru.pop(h, None)
        if e is not None:
            self.io.submit(_unlink, e.path)

    def _drop(self, e: Offloaded) -> None:
        self.num_dropped += 1
        self.bm.events.append(KVEvent("evicted", e.block_hash, e.namespace))

    # ---- the recall side ------------------------------------------------------------------------------------
    def hold(self, seq: Sequence) -> bool:
        """Scheduler, before admitting waiting `seq`: True while it must wait for a recall of its prefix (started
        now, or still copying); False when it may be scheduled (nothing to recall, its recall finished, or too few
        free device blocks to recall into: then it is scheduled as usual and recomputes what is missing)."""
        r = self.recalls.get(seq.seq_id)
        if r is not None:
            return not r.done
        bm = self.bm
        if seq.block_table or seq.wants_prompt_logprobs or not (self.host_lru or self.disk_lru):
            return False
        device: list[int] = []
        entries: list[Offloaded] = []
        parent = None
        bs = bm.block_size
        for i in range((seq.num_tokens - 1) // bs):  # as BlockManager.lookup: the last token's block never hits
            toks = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, toks, bm.fingerprint, seq.namespace)
            b = bm.cached.get(h)
            if b is not None and bm.tokens_of[b] == toks:
                device.append(b)
            else:
                e = self.host_lru.get(h) or self.disk_lru.get(h)
                if e is None or e.tokens != toks:
                    break
                entries.append(e)
            parent = h
        if not entries:
            return False
        if len(entries) + sum(1 for b in device if bm.ref[b] == 0) > bm.num_free:
            return False
        for b in device:  # pinned first: taking the targets below must not evict the chain's device part
            if bm.ref[b] == 0:
                del bm.evictable[b]
            bm.ref[b] += 1
        for e in entries:  # leave their tier first: making room on the device must not displace them
            (self.host_lru if e.tier == HOST else self.disk_lru).pop(e.block_hash)
        targets = [(e, bm._take()) for e in entries]
        r = Recall(seq, device + [d for _, d in targets], targets, time.perf_counter())
        for e in entries:
            r.tiers[e.tier] = r.tiers.get(e.tier, 0) + 1
        if self.cuda:  # D2H saves queued on the compute stream before now must land before we read host slots
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.kv.data.device))
            r.future = self.io.submit(self._copy_cuda, r, ready)
        else:
            r.future = self.io.submit(self._copy, r)
        self.recalls[seq.seq_id] = r
        return True

    def _source(self, e: Offloaded) -> torch.Tensor:
        if e.slot >= 0:
            return self.host[e.slot]
        raw = torch.from_numpy(numpy.fromfile(e.path, dtype=numpy.uint8))
        _unlink(e.path)
        return raw.view(self.host.dtype).view(self.block_shape)

    def _copy(self, r: Recall) -> None:  # I/O thread; the blocks written are held by the recall alone
        for e, d in r.targets:
            self.kv.data[d].copy_(self._source(e))

    def _copy_cuda(self, r: Recall, ready) -> None:  # I/O thread, own stream: never waits behind a forward
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for e, d in r.targets:
                src = self._source(e)
                self.kv.data[d].copy_(src, non_blocking=e.slot >= 0)
            done = torch.cuda.Event()
            done.record(self.stream)
        r.event = done

    def poll(self) -> None:
        """Start of a tick (engine thread): finished copies become device prefix-cache blocks."""
        for sid, r in list(self.recalls.items()):
            if r.done or not r.future.done():
                continue
            err = r.future.exception()
            if err is None and r.event is not None and not r.event.query():
                continue
            r.done = True
            self._complete(r, err)
            if r.cancelled:
                self.recalls.pop(sid, None)
                self._release(r)

    def _complete(self, r: Recall, err: BaseException | None) -> None:
        bm = self.bm
        for e, d in r.targets:
            if e.slot >= 0:
                self.host_free.append(e.slot)
            if err is not None:  # the copy failed: the entries are gone, the sequence recomputes them
                self._drop(e)
                continue
            self.bytes["host_to_device" if e.slot >= 0 else "disk_to_device"] += self.block_bytes
            if e.block_hash in bm.cached:  # computed again meanwhile by another sequence: that copy serves
                continue
            bm.cached[e.block_hash] = d
            bm.hash_of[d] = e.block_hash
            bm.tokens_of[d] = e.tokens
            bm.namespace_of[d] = e.namespace
            bm.events.append(KVEvent("stored", e.block_hash, e.namespace, DEVICE))
        if err is not None:
            log.warning("KV recall for %s failed (%s): recomputing", r.seq.request_id, err)
            return
        self.num_recalls += 1
        self.recall_seconds.append(time.perf_counter() - r.started)

    def admitted(self, seq: Sequence) -> None:
        """Scheduler, after `seq` got its blocks: it holds its own references now; count its tier hits."""
        r = self.recalls.pop(seq.seq_id, None)
        if r is None:
            return
        taken = set(seq.block_table)  # the recalled blocks it took as prefix hits (not one computed meanwhile)
        for e, d in r.targets:
            if d in taken:
                self.hit_tokens[e.tier] += self.bm.block_size
        self._release(r)

    def end_of_tick(self) -> None:
        """Scheduler, end of a tick: a finished recall whose sequence was not admitted in the tick it completed
        (blocked behind the queue's head, or out of budget) gives up its pins. Its blocks stay in the device
        prefix cache as ordinary evictable blocks: held any longer, a waiting sequence's pins could keep the
        queue's head from ever fitting in the pool."""
        for sid, r in list(self.recalls.items()):
            if r.done and not r.cancelled:
                self.recalls.pop(sid)
                self._release(r)

    def cancel(self, seq: Sequence) -> None:
        """`seq` left the scheduler (finished, cancelled, timed out): drop its recall's references, now if the
        copy is done, else when it is (the background copy may still be writing those blocks)."""
        r = self.recalls.get(seq.seq_id)
        if r is None:
            return
        if r.done:
            self.recalls.pop(seq.seq_id)
            self._release(r)
        else:
            r.cancelled = True

    def _release(self, r: Recall) -> None:
        for b in reversed(r.pins):
            self.bm.release_block(b)
        r.pins = []

    # ---- accounting -----------------------------------------------------------------------------------------
    def tier_of(self, h: int) -> str | None:
        if h in self.bm.cached:
            return DEVICE
        if h in self.host_lru:
            return HOST
        if h in self.disk_lru:
            return DISK
        return None

    def stats(self) -> TierStats:
        return TierStats(
            host_blocks_in_use=self.num_host_blocks - len(self.host_free), host_blocks_total=self.num_host_blocks,
            disk_blocks_in_use=len(self.disk_lru), disk_blocks_total=self.num_disk_blocks,
            recalls=self.num_recalls, recalls_in_flight=sum(1 for r in self.recalls.values() if not r.done),
            recall_seconds=tuple(self.recall_seconds), bytes_moved=MappingProxyType(dict(self.bytes)),
            hit_tokens=MappingProxyType(dict(self.hit_tokens)))
