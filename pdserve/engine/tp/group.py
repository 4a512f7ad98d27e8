"""Rank 0's side of a TP group: start ranks 1..N-1 as child processes, join them, watch them.

A rank that exits takes the whole worker down (`os._exit`): a worker missing a rank can run no forward, and a
half-alive process would keep heartbeating into the registry. Dying at once lets the registry entry lapse within
its TTL and the gateway's reroute/fail paths take the requests. The children die with rank 0 in turn
(PR_SET_PDEATHSIG, rank.py), and a collective waiting on a vanished peer fails.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdserve.engine.tp.comm import COLLECTIVE_TIMEOUT, TPComm
from pdserve.engine.tp.side_channel import SideChannel

log = logging.getLogger("pdserve.engine.tp")

RANK_EXIT_CODE = 70  # the worker's exit status when one of its ranks died (EX_SOFTWARE)


@dataclass
class RankArgs:
    """What a child rank is started with (one JSON argument)."""
    model_dir: str
    rank: int
    size: int
    store_port: int
    parent_pid: int
    dtype: str  # resolved by rank 0 (dtype=auto picks once, for all ranks)
    config: dict  # EngineConfig fields
    side_fd: int = -1  # this rank's end of its side channel to rank 0 (side_channel.py)


def rank_device(device: str, rank: int) -> torch.device:
    """CPU ranks share the host; CUDA rank r uses GPU r (rank 0: the configured device)."""
    d = torch.device(device)
    if d.type != "cuda" or rank == 0:
        return d
    return torch.device("cuda", rank)


class RankGroup:
    def __init__(self, procs: list[subprocess.Popen], side: list[SideChannel] | None = None):
        self.comm: TPComm | None = None  # set once every rank has joined
        self.procs = procs
        self.side = side or []  # side[i]: requests to rank i + 1 beside the step plans (its KV agent)
        self.stopping = False

    @classmethod
    def start(cls, model_dir: str, config, dtype: torch.dtype) -> "RankGroup":
        size = config.ranks
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        procs, side = [], []
        cfg = dataclasses.asdict(config)
        for r in range(1, size):
            mine, theirs = socket.socketpair()
            a = RankArgs(str(model_dir), r, size, store.port, os.getpid(), str(dtype).removeprefix("torch."), cfg,
                         theirs.fileno())
            procs.append(subprocess.Popen([sys.executable, "-m", "pdserve.engine.tp.rank",
                                           json.dumps(dataclasses.asdict(a))], pass_fds=[theirs.fileno()]))
            theirs.close()
            side.append(SideChannel(mine, name=f"rank{r}"))
        group = cls(procs, side)
        for r, p in enumerate(procs, start=1):
            threading.Thread(target=group._watch, args=(r, p), name=f"tp-rank{r}-watch", daemon=True).start()
        group.comm = TPComm("127.0.0.1", store.port, 0, size, rank_device(config.device, 0), store=store)
        log.info("tensor parallel group of %d ranks up (ranks 1..%d: pids %s)", size, size - 1,
                 ", ".join(str(p.pid) for p in procs))
        return group

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self.stopping:
            return
        log.critical("tensor parallel rank %d (pid %d) exited with status %s: the worker cannot run a forward "
                     "without it and exits now", rank, proc.pid, code)
        logging.shutdown()  # os._exit skips atexit: write the queued lines (this one included) first
        sys.stderr.flush()
        os._exit(RANK_EXIT_CODE)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Tell the ranks to exit (an empty plan), wait for them, kill stragglers. Idempotent."""
        if self.stopping:
            return
        self.stopping = True
        try:
            self.comm.broadcast_object(None)
        except Exception as e:  # a rank already gone: nothing to tell it
            log.warning("tensor parallel stop: %s", e)
        deadline = time.monotonic() + timeout_s
        for ch in self.side:
            ch.close()
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
