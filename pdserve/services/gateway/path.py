"""Which path served a request, and why: what `x-pdserve-path` says and `pdserve_requests_by_path_total` counts.

- `disagg`: prefilled on a prefill worker, its KV pulled by a decode worker;
- `local`: prefilled where it decodes, by the router's choice (predicted faster, a colocated deployment, the
  mode, a baseline policy);
- `fallback`: disaggregation was wanted and could not be done (the prefill pool unavailable: the router's
  `degraded_*` reasons), so the decode worker prefilled it itself.

The reason is the router's (router/cache_aware.py `_decide`: disagg_faster, local_faster, disagg_forced, ...).
`--require-disagg` turns a fallback into a 503 naming the reason instead of serving it locally.
"""
from __future__ import annotations

from pdserve.services.gateway.dispatch import NoWorkersError


class DisaggUnavailable(NoWorkersError):
    """--require-disagg and the router placed the request on one worker: `reason` is the router's."""

    def __init__(self, reason: str):
        super().__init__(f"disaggregation required and not possible now (router: {reason or 'unknown'})")
        self.reason = reason


def path_of(mode: str, reason: str) -> str:
    if mode == "disagg":
        return "disagg"
    return "fallback" if reason.startswith("degraded_") else "local"


def header(mode: str, reason: str) -> str:
    return f"{path_of(mode, reason)}; reason={reason or 'unknown'}"
