"""The NIXL agents of a tensor-parallel worker's other ranks: each rank's pool lives in its own process, so each
rank registers it with its own agent (named `<worker id>#tp<rank>`) and does its own READs.

Rank 0 drives them over the side channel (engine/tp/side_channel.py): open an agent (the worker learns each
rank's KVRegion for its KV handshake), read a peer's KV into the rank's share of the heads, forget a peer.
`RankKv` is the rank's side, `RankAgents` rank 0's.
"""
from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.agent import KVAgent, KVTransferError, TransferFailure
from pdserve.kv_transfer.layout import KVLayout, KVLayoutMismatch, KVRegion

log = logging.getLogger("pdserve.kv_transfer.tp_ranks")

# A prefill rank's agent polls for UCX progress at this interval. Measured (CMA between two processes): the
# owner's progress is needed only to wire up a new peer (with no polling the first READ never completes; at
# 100 ms it takes ~0.4 s, at 2 ms ~30 ms); established READs complete without it (~0.03-0.2 ms). So a slow
# poll, costing the rank's forwards little GIL time, delays only the first pull from each decode rank. No
# notification is sent to ranks other than 0 (tp_pull.py).
PUMP_INTERVAL_S = 0.01
# Beyond a READ's own timeout: how long rank 0 waits for a rank's answer (a rank that never answers is gone).
REPLY_GRACE_S = 10.0


@dataclass
class OpenAgent:
    name: str
    serve: bool  # a prefill pool: keep UCX progressing for peers' READs
    fingerprint: str  # the model's, as rank 0 computed it (the ranks load only their slices)


@dataclass
class Read:
    regions: list[KVRegion]
    src: list[int]
    dst: list[int]
    timeout_s: float


@dataclass
class ReadResult:
    nbytes: int = 0
    kind: str = ""  # TransferFailure value when it failed
    error: str = ""


@dataclass
class Forget:
    agent_name: str


@dataclass
class CloseAgent:
    pass


class RankKv:
    """In a rank process: the handler of rank 0's KV requests for this rank's pool."""

    def __init__(self, kv: torch.Tensor, layout: KVLayout):
        self.kv, self.layout = kv, layout
        self.agent: KVAgent | None = None

    def handle(self, msg):
        from pdserve.kv_transfer.tp_pull import read_for_rank
        if isinstance(msg, OpenAgent):
            if self.agent is None:
                self.layout = dataclasses.replace(self.layout, fingerprint=msg.fingerprint)
                self.agent = KVAgent(msg.name, self.kv, self.layout)
                if msg.serve:
                    self.agent.start_pump(interval_s=PUMP_INTERVAL_S)
                log.info("rank %d KV agent %s up (heads %s)", self.layout.tp_rank, msg.name, self.layout.heads)
            return self.agent.region()
        if isinstance(msg, Read):
            try:
                return ReadResult(read_for_rank(self.agent, msg.regions, msg.src, msg.dst, b"", msg.timeout_s))
            except KVTransferError as e:
                return ReadResult(0, e.kind.value, str(e))
            except KVLayoutMismatch as e:
                return ReadResult(0, TransferFailure.INCOMPATIBLE.value, str(e))
            except Exception as e:  # NIXL's own errors are RuntimeErrors
                return ReadResult(0, TransferFailure.NIXL_ERROR.value, repr(e))
        if isinstance(msg, Forget):
            if self.agent is not None:
                self.agent.forget_remote(msg.agent_name)
            return None
        if isinstance(msg, CloseAgent):
            if self.agent is not None:
                self.agent.close()
                self.agent = None
            return None
        raise TypeError(f"unknown KV request {type(msg).__name__}")


class RankAgents:
    """Rank 0's handle on ranks 1..N-1's agents (`channels[i]` reaches rank i + 1)."""

    def __init__(self, channels):
        self.channels = channels

    def open(self, worker_id: str, serve: bool, fingerprint: str, timeout_s: float = 60.0) -> list[KVRegion]:
        futs = [ch.call(OpenAgent(f"{worker_id}#tp{r}", serve, fingerprint))
                for r, ch in enumerate(self.channels, start=1)]
        return [f.result(timeout_s) for f in futs]

    def read(self, regions: list[KVRegion], src: list[int], dst: list[int], timeout_s: float) -> list[Future]:
        return [ch.call(Read(regions, list(src), list(dst), timeout_s)) for ch in self.channels]

    def result(self, fut: Future, timeout_s: float) -> int:
        """Bytes one rank moved; its failure as KVTransferError (a vanished rank: PEER_GONE)."""
        try:
            res: ReadResult = fut.result(timeout_s + REPLY_GRACE_S)
        except Exception as e:
            raise KVTransferError(f"tensor parallel rank did not answer its KV read: {e!r}",
                                  TransferFailure.PEER_GONE) from e
        if res.kind:
            raise KVTransferError(res.error, TransferFailure(res.kind))
        return res.nbytes

    def forget_remote(self, agent_name: str) -> None:
        for f in [ch.call(Forget(agent_name)) for ch in self.channels]:
            try:
                f.result(REPLY_GRACE_S)
            except Exception as e:  # best effort: a rank that cannot forget re-adds on its next READ's failure
                log.warning("rank could not forget KV peer %s: %s", agent_name, e)

    def close(self) -> None:
        for f in [ch.call(CloseAgent()) for ch in self.channels]:
            try:
                f.result(REPLY_GRACE_S)
            except Exception:
                pass
