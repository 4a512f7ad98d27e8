"""The collectives of one TP group: a standalone torch.distributed process group (gloo on CPU, NCCL on CUDA).

The group is built from a TCPStore directly (`ProcessGroupGloo(store, rank, size)`), not through
`init_process_group`: no process-global default group, so one process can hold several engines (tests do) and
nothing else in the process is affected. Byte counters feed bench/tp.py's check against the analytic volume."""
from __future__ import annotations

import datetime
import pickle

import torch
import torch.distributed as dist

# No timeout in practice: the other ranks wait in a broadcast for the next plan however long the worker idles;
# a dead peer is caught by the process monitor (group.py), PR_SET_PDEATHSIG (rank.py) and closed sockets.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=3650)


class TPComm:
    def __init__(self, store_host: str, store_port: int, rank: int, size: int, device: torch.device,
                 store: dist.TCPStore | None = None):
        self.rank, self.size, self.device = rank, size, device
        self.store = store or dist.TCPStore(store_host, store_port, size, rank == 0, timeout=COLLECTIVE_TIMEOUT)
        if device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(self.store, rank, size)
        else:  # all ranks of a worker share its host: loopback, whatever the pod's hostname resolves to
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            opts._timeout = COLLECTIVE_TIMEOUT
            self.pg = dist.ProcessGroupGloo(self.store, rank, size, opts)
        self.bytes_reduced = 0  # payload bytes handed to all-reduce by this rank
        self.bytes_gathered = 0  # payload bytes this rank sent to the logits gather
        self.bytes_plan = 0  # plan bytes broadcast from rank 0
        # expert parallelism by all-to-all (dispatch.py): bytes this rank sends to the other ranks
        self.bytes_all_to_all = 0  # token rows out to the experts' owners and expert outputs back
        self.bytes_all_gathered = 0  # the routing counts and the layer's output slices
        self.bytes_reduce_scattered = 0  # payload handed to reduce-scatter (the attention output, sliced)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks in place (the row-parallel projections' partial sums)."""
        self.bytes_reduced += t.numel() * t.element_size()
        if not t.is_contiguous():
            t = t.contiguous()
        self.pg.allreduce([t]).wait()
        return t

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """Rank r's 1/N of the rows of `t` ([N * c, ...]) summed over the ranks: [c, ...]."""
        t = t.contiguous()
        self.bytes_reduce_scattered += t.numel() * t.element_size()
        out = t.new_empty((t.shape[0] // self.size, *t.shape[1:]))
        self.pg.reduce_scatter([out], [list(t.chunk(self.size))], dist.ReduceScatterOptions()).wait()
        return out

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (same shape) concatenated on dim 0, on every rank."""
        t = t.contiguous()
        self.bytes_all_gathered += t.numel() * t.element_size() * (self.size - 1)
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([out], [t]).wait()
        return torch.cat(out)

    def all_to_all(self, t: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of `t` out in consecutive runs of send[i] rows to rank i; back the recv[i] rows each rank i sends
        here, concatenated in rank order (torch.distributed.all_to_all_single with split sizes)."""
        t = t.contiguous()
        row = t[0].numel() * t.element_size() if t.shape[0] else 0
        self.bytes_all_to_all += (sum(send) - send[self.rank]) * row
        out = t.new_empty((sum(recv), *t.shape[1:]))
        self.pg.alltoall_base(out, t, recv, send, dist.AllToAllOptions()).wait()
        return out

    def gather0(self, t: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `t` (same shape) concatenated on the last dim on rank 0; None elsewhere."""
        t = t.contiguous()
        self.bytes_gathered += t.numel() * t.element_size()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            out = [torch.empty_like(t) for _ in range(self.size)]
            self.pg.gather([out], [t], opts).wait()
            return torch.cat(out, dim=-1)
        self.pg.gather([], [t], opts).wait()
        return None

    def min_int(self, n: int) -> int:
        """The smallest of every rank's `n` (the KV pool size all ranks can hold)."""
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        t = torch.tensor([n], dtype=torch.long, device=dev)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled: a length, then the bytes; two broadcasts)."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            n = torch.tensor([data.numel()], dtype=torch.long, device=dev)
        else:
            n = torch.zeros(1, dtype=torch.long, device=dev)
        self.pg.broadcast([n], opts).wait()
        if self.rank != 0:
            data = torch.empty(int(n.item()), dtype=torch.uint8)
        buf = data.to(dev)
        self.pg.broadcast([buf], opts).wait()
        self.bytes_plan += buf.numel()
        return obj if self.rank == 0 else pickle.loads(buf.cpu().numpy().tobytes())
