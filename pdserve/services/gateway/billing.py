"""The billing record: one per client request (spec §1.7), a JSON line of the `pdserve.billing` logger.

Two writers make it: the gateway that ended the request (lifecycle.py, from its RequestRecord) and a live replica
finalising the request of one that died (usage_ledger.py, from what admission knew). Both build this one type, so
the two lines carry the same fields and count billed tokens the same way.

Billed tokens: prompt + committed (the answer the client got whole); 0 for a REJECTED request, which ran nothing
even when it was rejected after tokenizing (admission: 400 / 503) and its prompt length is known. The same number
is charged to the tenant's quota.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class BillingTimes:
    """Wall-clock seconds (time.time()) of the request's gateway milestones; None: never reached."""
    arrival: float
    finished: float
    admitted: float | None = None
    first_emit: float | None = None
    last_emit: float | None = None
    deadline: float | None = None
    queued_s: float = 0.0  # time admission held it QUEUED


@dataclass(frozen=True)
class BillingRecord:
    request_id: str
    tenant: str
    model: str
    state: str  # the terminal state: FINISHED / CANCELLED / TIMED_OUT / FAILED / REJECTED
    times: BillingTimes
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0  # sampled by the workers
    emitted_tokens: int = 0    # handed to the client connection
    committed_tokens: int = 0  # in the answer the client got whole
    n_requested: int | None = None
    n_granted: int | None = None
    predicted_output_tokens: int | None = None
    reserved_blocks: int = 0
    admission: tuple[str, ...] = ()  # admission's trail: QUEUED / DEGRADED
    error: str | None = None
    # mid-stream migration (docs/reliability.md): tokens prefilled again on the workers that took the request
    # over (prompt + tokens already sent, less prefix-cache hits), apart from the billed counts
    migrations: int = 0
    recomputed_tokens: int = 0
    # disaggregated: the KV bytes the decode workers pulled and the pulls' time (stages.kv_moved)
    kv_bytes: int = 0
    kv_transfer_s: float = 0.0
    finalised_by: str | None = field(default=None)  # the replica that wrote it for a dead one (usage_ledger.py)

    @property
    def billed_prompt_tokens(self) -> int:
        return 0 if self.state == "REJECTED" else self.prompt_tokens

    @property
    def billed_tokens(self) -> int:
        return 0 if self.state == "REJECTED" else self.prompt_tokens + self.committed_tokens

    def to_json(self) -> dict:
        """The JSON line's fields: the counts, billed_tokens after committed_tokens, then the rest, times last."""
        d = asdict(self)
        times = d.pop("times")
        out: dict = {}
        for k, v in d.items():
            out[k] = list(v) if k == "admission" else v
            if k == "committed_tokens":
                out["billed_tokens"] = self.billed_tokens
        out["times"] = times
        return out
