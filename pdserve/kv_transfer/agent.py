"""NIXL agent wrapper around one engine KV tensor.

The whole KV tensor ([num_blocks, ...], each block contiguous) is registered once. Descriptor lists with one
entry per block are prepared once (locally, and per remote peer on first use), so a transfer is a
`make_prepped_xfer` over block *indices*: one batched READ whatever the number of blocks, and no per-transfer
descriptor building.
"""
from __future__ import annotations

import contextlib
import enum
import math
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

try:  # the pinned wheel is nixl-cu12; CUDA 13 hosts carry nixl-cu13; upstream builds install `nixl`
    from nixl_cu12._api import nixl_agent, nixl_agent_config
except ImportError:  # pragma: no cover
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]

from pdserve.kv_transfer.hugepages import use_huge_pages
from pdserve.kv_transfer.layout import KVLayout, KVRegion, check_compatible

# The largest staging buffer an agent keeps between pulls (tp_pull.py); larger pulls allocate their own.
STAGING_KEEP_BYTES = 256 << 20
# After a failed transfer, how long close() drives UCX progress before tearing the agent down (see close)
SETTLE_S = 0.1


class TransferFailure(enum.Enum):
    """Why a KV pull failed (the value is the `reason` label of pdserve_kv_transfer_failures_total)."""

    TIMEOUT = "timeout"                # the READ did not finish before its deadline
    PEER_GONE = "peer_gone"            # the peer cannot be reached (process died, restarted, unreachable)
    NIXL_ERROR = "nixl_error"          # NIXL reported ERR for the transfer
    INCOMPATIBLE = "incompatible"      # the peers refused to pair: KV protocol version or layout differs
    LEASE_EXPIRED = "lease_expired"    # the source blocks' lease ran out before the READ could start


class KVTransferError(RuntimeError):
    """A KV transfer (or the handshake before it) failed; `kind` says why."""

    def __init__(self, message: str, kind: TransferFailure):
        super().__init__(message)
        self.kind = kind


def _descs(base: int, num_blocks: int, block_bytes: int, dev: int) -> np.ndarray:
    a = np.empty((num_blocks, 3), dtype=np.uint64)
    a[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    a[:, 1] = block_bytes
    a[:, 2] = dev
    return a


class KVAgent:
    def __init__(self, name: str, kv: torch.Tensor, layout: KVLayout | dict, backends: list[str] | None = None,
                 progress_thread: bool = False, huge_pages: bool = True):
        if not kv.is_contiguous():
            raise ValueError("KV tensor must be contiguous (one descriptor per block)")
        self.name = name
        self.kv = kv
        self.layout = layout if isinstance(layout, KVLayout) else KVLayout.from_dict(layout)
        self.num_blocks = kv.shape[0]
        self.block_bytes = kv[0].numel() * kv.element_size()
        if self.layout.block_bytes and self.layout.block_bytes != self.block_bytes:
            raise ValueError(f"layout block_bytes {self.layout.block_bytes} != tensor block bytes {self.block_bytes}")
        self.mem_type = "DRAM" if kv.device.type == "cpu" else "VRAM"
        self.device_id = 0 if kv.device.type == "cpu" else kv.device.index or 0
        # NIXL agents are not thread-safe in sync mode NONE: every call goes through this lock.
        self._lock = threading.Lock()
        # NIXL's progress thread busy-polls (~50% of a core even when idle), which starves the engine's step loop
        # on small CPU boxes. Instead an initiator drives progress by polling its own transfer, and the owner of
        # blocks (prefill side) runs `start_pump`: a thread polling notifications every millisecond, which also
        # progresses the UCX worker so remote READs complete.
        # CMA copies page by page: huge pages make a READ between two processes ~2x faster (hugepages.py)
        self.huge_page_bytes = use_huge_pages(kv) if huge_pages else 0
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread,
                                                          backends=backends or ["UCX"]))
        self._reg = self._agent.register_memory(kv)
        self._local = self._agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _descs(kv.data_ptr(), self.num_blocks, self.block_bytes, self.device_id), self.mem_type)
        self._remotes: dict[tuple[str, int], object] = {}  # (agent name, base addr) -> prepped remote dlist
        self._stage: tuple[torch.Tensor, object] | None = None  # a kept staging buffer and its registration
        self._stage_lock = threading.Lock()
        self.faulted = False  # a transfer failed (peer gone, ERR, timeout): close() settles UCX first

    def region(self) -> KVRegion:
        with self._lock:
            md = self._agent.get_agent_metadata()
        return KVRegion(self.name, md, self.kv.data_ptr(), self.num_blocks, self.device_id, self.mem_type,
                        self.layout)

    def _remote_dlist(self, r: KVRegion):
        key = (r.agent_name, r.base_addr)
        dl = self._remotes.get(key)
        if dl is None:
            check_compatible(self.layout, r.layout)
            try:
                name = self._agent.add_remote_agent(r.agent_metadata)
            except Exception as e:  # the peer's endpoint is unreachable (e.g. the process died)
                raise self._failed(f"cannot connect to NIXL peer {r.agent_name}: {e!r}",
                                   TransferFailure.PEER_GONE) from e
            name = name.decode() if isinstance(name, bytes) else name
            if name != r.agent_name:
                raise self._failed(f"remote metadata names agent {name!r}, expected {r.agent_name!r}",
                                   TransferFailure.PEER_GONE)
            try:
                dl = self._agent.prep_xfer_dlist(
                    r.agent_name, _descs(r.base_addr, r.num_blocks, r.layout.block_bytes or self.block_bytes,
                                         r.device_id), r.mem_type)
            except Exception as e:
                raise self._failed(f"cannot prepare descriptors for {r.agent_name}: {e!r}",
                                   TransferFailure.NIXL_ERROR) from e
            self._remotes[key] = dl
        return dl

    def read_blocks(self, remote: KVRegion, remote_block_ids: list[int], local_block_ids: list[int],
                    notif: bytes = b"", timeout_s: float = 30.0) -> int:
        """Pull remote blocks into local blocks with ONE batched READ; return bytes moved.

        Blocks until DONE; raises KVTransferError on ERR or timeout, KVLayoutMismatch on an incompatible peer.
        """
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError("remote and local block lists differ in length")
        if not remote_block_ids:
            return 0
        if max(remote_block_ids) >= remote.num_blocks or max(local_block_ids) >= self.num_blocks or \
                min(remote_block_ids) < 0 or min(local_block_ids) < 0:
            raise ValueError("block id out of range")
        with self._lock:
            rdl = self._remote_dlist(remote)  # KVLayoutMismatch propagates as is
            started = self._start(remote.agent_name, lambda: self._agent.make_prepped_xfer(
                "READ", self._local, np.asarray(local_block_ids, dtype=np.int32), rdl,
                np.asarray(remote_block_ids, dtype=np.int32), notif))
        self._wait([started], timeout_s)
        return len(remote_block_ids) * self.block_bytes

    def read_descs(self, reads: list[tuple[KVRegion, np.ndarray, np.ndarray]], notif: bytes = b"",
                   timeout_s: float = 30.0) -> int:
        """One batched READ per (remote region, local descriptors, remote descriptors) entry, all in flight at
        once (tp_plan.descs builds them: head slices between pools of different TP degrees); return bytes moved.
        Raises like read_blocks."""
        started: list[tuple[str, object, str]] = []
        try:
            for remote, local_d, remote_d in reads:
                if local_d.shape != remote_d.shape or (local_d[:, 1] != remote_d[:, 1]).any():
                    raise ValueError("local and remote descriptors differ in count or length")
                if not len(local_d):
                    continue
                with self._lock:
                    self._remote_dlist(remote)  # adds the peer, checks its layout (KVLayoutMismatch as is)
                    started.append(self._start(remote.agent_name, lambda: self._agent.initialize_xfer(
                        "READ", self._agent.get_xfer_descs(local_d, self.mem_type),
                        self._agent.get_xfer_descs(remote_d, remote.mem_type), remote.agent_name, notif)))
        except BaseException:
            self._wait(started, timeout_s, raise_errors=False)  # never leave a READ writing into our blocks
            raise
        self._wait(started, timeout_s)
        return int(sum(int(local_d[:, 1].sum()) for _, local_d, _ in reads))

    def _start(self, peer: str, create) -> tuple[str, object, str]:
        """Create a READ with `create()` and post it (under self._lock): (peer, handle, state). Either step failing
        (nixlBackendError etc.: peer gone, connection refused) is PEER_GONE. A post that fails releases its handle
        here: left to the garbage collector, it would be released after close() tore the agent down."""
        h = None
        try:
            h = create()
            return peer, h, self._agent.transfer(h)
        except Exception as e:
            if h is not None:
                try:
                    self._agent.release_xfer_handle(h)
                except Exception:
                    pass
            raise self._failed(f"KV transfer from {peer} could not start: {e!r}", TransferFailure.PEER_GONE) from e

    def _failed(self, message: str, kind: TransferFailure) -> KVTransferError:
        self.faulted = True
        return KVTransferError(message, kind)

    @contextlib.contextmanager
    def staging(self, shape: tuple[int, ...], dtype: torch.dtype):
        """A registered scratch tensor on the pool's device to READ into (tp_pull.py). One buffer up to
        STAGING_KEEP_BYTES is kept and reused, so a pull does not pay for fresh pages (faulting 32 MiB in costs
        about as much as copying it); a pull that finds it in use, or needs more, gets a buffer of its own."""
        n = math.prod(shape) * dtype.itemsize
        if n <= STAGING_KEEP_BYTES and self._stage_lock.acquire(blocking=False):
            try:
                if self._stage is None or self._stage[0].numel() < n:
                    self._drop_stage()
                    t = torch.zeros(n, dtype=torch.uint8, device=self.kv.device)  # zeros: pages faulted in now
                    with self._lock:
                        self._stage = (t, self._agent.register_memory(t))
                yield self._stage[0][:n].view(dtype).view(shape)
            finally:
                self._stage_lock.release()
            return
        t = torch.empty(n, dtype=torch.uint8, device=self.kv.device)
        with self._lock:
            reg = self._agent.register_memory(t)
        try:
            yield t.view(dtype).view(shape)
        finally:
            with self._lock:
                self._agent.deregister_memory(reg)

    def _drop_stage(self) -> None:
        if self._stage is not None:
            with self._lock:
                try:
                    self._agent.deregister_memory(self._stage[1])
                except Exception:
                    pass
            self._stage = None

    def _wait(self, handles: list[tuple[str, object, str]], timeout_s: float, raise_errors: bool = True) -> None:
        """Poll the transfers until each is DONE or ERR, then release them; the first failure is raised."""
        deadline = time.monotonic() + timeout_s
        sleep = 0.0
        states = {i: st for i, (_, _, st) in enumerate(handles)}
        reasons: dict[int, str] = {}
        failure: KVTransferError | None = None
        try:
            while True:
                pending = [i for i, st in states.items() if st not in ("DONE", "ERR")]
                if not pending:
                    break
                if time.monotonic() > deadline:
                    failure = self._failed(f"KV transfer from {handles[pending[0]][0]} timed out after "
                                           f"{timeout_s}s", TransferFailure.TIMEOUT)
                    break
                if sleep:
                    time.sleep(sleep)
                sleep = min(sleep * 2 or 1e-5, 1e-3)  # spin briefly, then back off: small transfers finish fast
                with self._lock:
                    for i in pending:
                        try:
                            states[i] = self._agent.check_xfer_state(handles[i][1])
                        except Exception as e:  # NIXL's own classes, not RuntimeError: a handle it dropped (its
                            # peer's connection failed: NIXL_ERR_NOT_FOUND), a disconnect; the READ is over
                            states[i], reasons[i] = "ERR", f"{type(e).__name__}: {e}"
            errs = [i for i, st in states.items() if st == "ERR"]
            if failure is None and errs:
                failure = self._failed(f"KV transfer from {handles[errs[0]][0]} failed "
                                       f"({reasons.get(errs[0], 'NIXL state ERR')})", TransferFailure.NIXL_ERROR)
        finally:
            with self._lock:
                for _, h, _ in handles:
                    try:
                        self._agent.release_xfer_handle(h)
                    except Exception:  # an in-flight handle cannot be released; NIXL reclaims it at agent teardown
                        pass
        if failure is not None and raise_errors:
            raise failure

    def forget_remote(self, agent_name: str) -> None:
        """Drop a peer (e.g. it died) so a restarted peer with the same name is re-added."""
        with self._lock:
            for key in [k for k in self._remotes if k[0] == agent_name]:
                dl = self._remotes.pop(key)
                try:
                    self._agent.release_dlist_handle(dl)
                except Exception:
                    pass
            try:
                self._agent.remove_remote_agent(agent_name)
            except Exception:
                pass

    def start_pump(self, on_notif=None, interval_s: float = 0.001, active: Callable[[], bool] | None = None,
                   idle_interval_s: float = 0.05) -> None:
        """Poll notifications (and thereby UCX progress) in a daemon thread; call on_notif(msg) for each.

        Every poll takes the GIL, and 1000 of them a second slow a 1-thread engine forward in the same process by
        ~10% (prefill 5.3 -> 5.8 ms on the built-in model). With `active` given, the pump polls every
        `interval_s` only while active() is true (e.g. leases are outstanding: a READ and its notification can
        come) and otherwise every `idle_interval_s`, or at once after `wake_pump()`.
        """
        if getattr(self, "_pump", None):
            return
        self._pump_stop = threading.Event()
        self._pump_wake = threading.Event()

        def run():
            while not self._pump_stop.is_set():
                for m in self.poll_notifs():
                    if on_notif:
                        try:
                            on_notif(m)
                        except Exception:  # a bad callback must not stop progress for everyone else
                            pass
                if active is None or active():
                    self._pump_stop.wait(interval_s)
                else:  # set before active() turns true is fine: the wait then returns at once
                    self._pump_wake.wait(idle_interval_s)
                    self._pump_wake.clear()

        self._pump = threading.Thread(target=run, name=f"nixl-pump-{self.name}", daemon=True)
        self._pump.start()

    def wake_pump(self) -> None:
        """Back to fast polling now (call after making active() true)."""
        ev = getattr(self, "_pump_wake", None)
        if ev is not None:
            ev.set()

    def stop_pump(self) -> None:
        if getattr(self, "_pump", None):
            self._pump_stop.set()
            self._pump_wake.set()
            self._pump.join(1)
            self._pump = None

    def close(self) -> None:
        """Tear down in order (pump, prepped lists, registration, agent) so no NIXL/UCX thread outlives it.

        After a failed transfer UCX still holds the failed endpoint's queued operations until its worker makes
        progress; destroying the agent before that aborts the process (UCX's `ucs_arbiter_group_is_empty`
        assertion: in one of 8 runs of a READ from a killed peer here, whenever NIXL saw the disconnect before
        UCX did). So a faulted agent polls for SETTLE_S first (each poll progresses the worker)."""
        self.stop_pump()
        if self.faulted and self._agent is not None:
            end = time.monotonic() + SETTLE_S
            while time.monotonic() < end:
                self.poll_notifs()
                time.sleep(0.002)
        with self._stage_lock:
            self._drop_stage()
        with self._lock:
            for dl in list(self._remotes.values()) + [self._local]:
                try:
                    self._agent.release_dlist_handle(dl)
                except Exception:
                    pass
            self._remotes.clear()
            try:
                self._agent.deregister_memory(self._reg)
            except Exception:
                pass
            self._agent = None

    def poll_notifs(self) -> list[bytes]:
        """Notifications peers attached to READs of our blocks (the lease id: the pull is done)."""
        with self._lock:
            n = self._agent.get_new_notifs()
        return [m for msgs in n.values() for m in msgs]
