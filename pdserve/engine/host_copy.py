"""Host <-> device traffic of the sampler, kept to two shapes so that a step never waits on the device mid-pipeline.

* host -> device: per-row parameters (row indices, temperatures, penalty ids, bias values, grammar bitmasks)
  are built as host tensors and sent with `to_device`: pinned memory and `non_blocking=True` on CUDA, so the copy
  is queued on the stream behind the forward instead of synchronising with it (a pageable copy makes PyTorch
  wait for the stream). The caching host allocator keeps the pinned buffer alive until the copy has run.
* device -> host: everything the host needs from a step (token ids, dead-end flags, log-probs, top-n lists) is
  packed into one float64 tensor and read with a single `tolist` (`read_back`): the one synchronising copy of
  the step. float64 holds token ids (< 2^53) and float32 log-probs exactly.

On CPU both are plain tensor operations: no copy, no pinning.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(data: Sequence | Tensor, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """`data` (a list or a host tensor) as a tensor on `device`, copied without a stream synchronisation."""
    t = data if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def read_back(parts: list[Tensor]) -> list[float]:
    """The step's one device -> host copy: `parts` (any shapes, dtypes, one device) flattened into one list."""
    if not parts:
        return []
    return torch.cat([p.reshape(-1).to(torch.float64) for p in parts]).tolist()
