"""A worker changing role in its process (prefill <-> decode, to or from `both`): weights and KV pool kept.

The switch is one small state machine, its whole table below (TABLE); `RoleSwitch` holds the state and
refuses any step the table lacks, so a second switch request mid-switch, or a step out of order, is an error
rather than a silent race.

    serving --request--> draining --drained--> repartitioning --ready--> registering --registered--> serving
                         draining --timeout--> restoring --registered--> serving   (the old role again)
                         repartitioning --failed--> restoring

- draining: the registry record says role `switching` (no placement picks it: router/candidates.py), so routers
  stop choosing the worker at their next view refresh; until then a call of any serving kind is refused
  UNAVAILABLE, which the gateway answers by placing it elsewhere (nothing emitted yet, so nothing is lost).
  What the worker holds finishes here: its streams, and a prefill worker's KV pinned under leases until it is
  pulled or its lease ends. Requests are never cut: the drain waits, and past its timeout the switch is undone.
  With handoff `migrate` the streams do not run to their end here: each single-branch stream ends at its next
  message (after its first, so the gateway has a token to resume from and a prefill side's KV is already
  pulled) with UNAVAILABLE `HANDOFF`, which the gateway's mid-stream migration answers by resuming it on
  another worker from the tokens the client has (docs/reliability.md): the same tokens, greedy or seeded.
  Several branches (n > 1, best_of, beam) cannot resume, so those streams still finish here.
- repartitioning: the KV pool is the same size for every role (`up` and the chart give every role the same
  engine flags), so nothing is re-sized; a worker started as `both` has no KV transfer agent yet and gets one.
- registering: the record says the new role, written at once rather than at the next heartbeat.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("pdserve.worker")

ROLES = ("prefill", "decode", "both")
# Refusals of a call a switch made unwelcome (mid-switch, or placed on the old role by a router whose view predates
# the switch) start with this: UNAVAILABLE before anything is emitted, so the gateway places the call elsewhere,
# and it does not hold the worker suspect (gateway/suspects.py) as it would a dead one: it serves again at once.
REFUSAL = "role switch: "
# The least a switch keeps the worker out of every pool: longer than the routers' view refresh (0.2 s by
# default), so calls placed on the old role's record have mostly arrived (and are drained) before the new role is
# registered; the few later ones are refused with REFUSAL.
SETTLE_S = 0.3
SWITCHING = "switching"  # the registry role while a switch is in progress
# How a switching worker's streams end (SwitchRoleRequest.handoff): finished where they are, or moved.
DRAIN, MIGRATE = "drain", "migrate"
HANDOFFS = (MIGRATE, DRAIN)
# The status detail of a stream ended by a handoff: a refusal (REFUSAL: the worker is not suspect), that the
# gateway tells apart from a refusal before any token (is_handoff) to migrate it rather than fail it.
HANDOFF = f"{REFUSAL}handoff"

SERVING, DRAINING, REPARTITIONING, REGISTERING, RESTORING = (
    "serving", "draining", "repartitioning", "registering", "restoring")

TABLE: dict[tuple[str, str], str] = {
    (SERVING, "request"): DRAINING,
    (DRAINING, "drained"): REPARTITIONING,
    (DRAINING, "timeout"): RESTORING,
    (REPARTITIONING, "ready"): REGISTERING,
    (REPARTITIONING, "failed"): RESTORING,
    (REGISTERING, "registered"): SERVING,
    (RESTORING, "registered"): SERVING,
}


class SwitchRefused(Exception):
    """The switch cannot start (unknown role, one already in progress, this worker cannot take the role)."""


@dataclass
class SwitchResult:
    old_role: str
    role: str
    switched: bool
    seconds: float
    drain_s: float
    drained_requests: int
    error: str = ""
    handed_off: int = 0  # streams ended by a `migrate` handoff (the gateway resumed them elsewhere)
    handoff: str = DRAIN


class RoleSwitch:
    """The state of one worker's role switches. `fire` is the only way to move; `accepts_work` says whether new
    work may start (not while a switch is in progress)."""

    def __init__(self, role: str):
        self.role = role
        self.state = SERVING
        self.target = ""
        self.handoff = DRAIN  # of the switch in progress

    def fire(self, event: str) -> str:
        nxt = TABLE.get((self.state, event))
        if nxt is None:
            raise SwitchRefused(f"role switch: no step {event!r} from state {self.state!r}")
        self.state = nxt
        return nxt

    def begin(self, target: str, handoff: str = DRAIN) -> None:
        if target not in ROLES:
            raise SwitchRefused(f"unknown role {target!r} (one of {', '.join(ROLES)})")
        if handoff not in HANDOFFS:
            raise SwitchRefused(f"unknown handoff {handoff!r} (one of {', '.join(HANDOFFS)})")
        if self.state != SERVING:
            raise SwitchRefused(f"a switch to {self.target} is in progress ({self.state})")
        self.fire("request")
        self.target, self.handoff = target, handoff

    def finish(self, switched: bool) -> None:
        if switched:
            self.role = self.target
        self.fire("registered")
        self.target = ""

    @property
    def hands_off(self) -> bool:
        """Streams are to leave now (a `migrate` switch is draining)."""
        return self.state == DRAINING and self.handoff == MIGRATE

    @property
    def accepts_work(self) -> bool:
        return self.state == SERVING

    @property
    def registry_role(self) -> str:
        return self.role if self.state == SERVING else SWITCHING

    @property
    def in_progress(self) -> str:
        """"prefill->decode" while switching, else ""."""
        return f"{self.role}->{self.target}" if self.state != SERVING else ""


def is_refusal(details: str | None) -> bool:
    return (details or "").startswith(REFUSAL)


def is_handoff(details: str | None) -> bool:
    return (details or "").startswith(HANDOFF)


def resumable(params) -> bool:
    """A stream the gateway can resume elsewhere (gateway/migration.py: one branch; engine/resume.py: no beam)."""
    return params.num_branches == 1 and not params.beam


async def drain(held, timeout_s: float, poll_s: float = 0.02, settle_s: float = 0.0) -> bool:
    """Wait until `held()` (requests in flight plus pinned KV leases) is 0, and at least `settle_s`; False at the
    timeout."""
    t0 = time.monotonic()
    end = t0 + timeout_s
    while held() or time.monotonic() - t0 < settle_s:
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(poll_s)
    return True
