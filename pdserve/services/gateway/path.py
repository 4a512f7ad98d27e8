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


class PathHeader:
    """`x-pdserve-path` in `headers` as placements happen. For a one-prompt request it names the latest
    placement, so a whole answer names the path that produced it: a placement on one worker after a
    disaggregated one is a `fallback` (the KV never arrived, or its decode worker failed, and the request was
    prefilled again where it decodes), with `placements=N`. A stream's headers leave with its first token, so
    a stream names its first placement. With several prompts, the first placement of the first."""

    def __init__(self, n_subs: int, headers: dict[str, str]):
        self.n_subs, self.headers = n_subs, headers
        self.placements = 0
        self.was_disagg = False

    def place(self, mode: str, reason: str) -> None:
        self.placements += 1
        if self.n_subs > 1:
            self.headers.setdefault("x-pdserve-path", header(mode, reason))
            return
        path = path_of(mode, reason)
        if path == "local" and self.was_disagg:
            path = "fallback"
        self.was_disagg |= mode == "disagg"
        more = f"; placements={self.placements}" if self.placements > 1 else ""
        self.headers["x-pdserve-path"] = f"{path}; reason={reason or 'unknown'}{more}"
