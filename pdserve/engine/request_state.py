"""The spec's 14-state request machine (§0.2): one enum, one transition table, one way to move."""
from __future__ import annotations

import enum

from pdserve.engine.errors import IllegalTransition


class RequestState(enum.Enum):
    REJECTED = "REJECTED"
    QUEUED = "QUEUED"
    DEGRADED = "DEGRADED"
    RUNNABLE = "RUNNABLE"
    PREFILLING = "PREFILLING"
    DECODING = "DECODING"
    BACKPRESSURED = "BACKPRESSURED"
    PREEMPTED = "PREEMPTED"
    SWAPPED = "SWAPPED"
    RESUMED = "RESUMED"
    TIMED_OUT = "TIMED_OUT"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"
    FINISHED = "FINISHED"

    @property
    def terminal(self) -> bool:
        return self._terminal  # set below from TERMINAL: asked several times per token, a set lookup hashes by name


S = RequestState
TERMINAL = frozenset({S.REJECTED, S.TIMED_OUT, S.CANCELLED, S.FAILED, S.FINISHED})
for _state in RequestState:
    _state._terminal = _state in TERMINAL
# Cancellation and worker failure can strike any live state; the rest follows the spec's guard table.
_ANY_LIVE = {S.CANCELLED, S.FAILED}
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    S.QUEUED: frozenset({S.RUNNABLE, S.TIMED_OUT, S.DEGRADED} | _ANY_LIVE),
    S.DEGRADED: frozenset({S.RUNNABLE, S.TIMED_OUT} | _ANY_LIVE),
    S.RUNNABLE: frozenset({S.PREFILLING, S.DECODING, S.PREEMPTED, S.TIMED_OUT} | _ANY_LIVE),
    S.PREFILLING: frozenset({S.DECODING, S.FINISHED, S.BACKPRESSURED, S.PREEMPTED, S.TIMED_OUT} | _ANY_LIVE),
    S.DECODING: frozenset({S.FINISHED, S.BACKPRESSURED, S.PREEMPTED, S.TIMED_OUT} | _ANY_LIVE),
    S.BACKPRESSURED: frozenset({S.DECODING, S.PREEMPTED, S.TIMED_OUT} | _ANY_LIVE),
    S.PREEMPTED: frozenset({S.RESUMED, S.SWAPPED, S.TIMED_OUT} | _ANY_LIVE),
    S.SWAPPED: frozenset({S.RESUMED, S.TIMED_OUT} | _ANY_LIVE),
    S.RESUMED: frozenset({S.RUNNABLE, S.TIMED_OUT} | _ANY_LIVE),
    S.REJECTED: frozenset(),
    S.TIMED_OUT: frozenset(),
    S.CANCELLED: frozenset(),
    S.FAILED: frozenset(),
    S.FINISHED: frozenset(),
}
# A request enters the machine at admission: admitted (QUEUED) or refused (REJECTED).
INITIAL = frozenset({S.QUEUED, S.REJECTED})


# How many times any sequence entered each state, process-wide. Transient states (RUNNABLE, RESUMED) last less
# than a tick, so a gauge would never show them; this counter makes every state visible (metrics export it).
ENTERED: dict[str, int] = {s.value: 0 for s in RequestState}


def enter_rejected() -> RequestState:
    """A request refused before the engine held anything for it (invalid parameters, a schema that does not
    compile, a prompt that can never fit): the NEW -> REJECTED move, counted like any other entry. It never gets
    a Sequence (nothing of it exists to carry one), so this is its whole life in the machine."""
    check_transition(None, S.REJECTED)
    ENTERED[S.REJECTED.value] += 1
    return S.REJECTED


def check_transition(old: RequestState | None, new: RequestState) -> None:
    allowed = INITIAL if old is None else TRANSITIONS[old]
    if new not in allowed:
        raise IllegalTransition(f"illegal request transition {old.value if old else 'NEW'} -> {new.value}")
