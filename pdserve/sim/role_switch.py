"""A role switch in the simulator: what services/role_switch.py does to a worker, on the virtual clock.

    decided --withdraw--> draining --drained--> (switch_s) --> serving in the new role
                          draining --timeout--> serving in the old role again (nothing is cut)

- withdraw: the replica leaves every placement pool at once (its record says `switching`: no policy picks it).
  The real router's view is up to 0.2 s staler and the few calls placed meanwhile are refused and re-placed;
  the simulator does not model those.
- drain: what the replica holds finishes where it is. A prefill replica keeps a prompt's KV pinned until the decode
  side has pulled it (the commit after the transfer; leases never expire in the simulator), so it is drained once
  its scheduler is empty and nothing is pinned. A decode replica finishes its streams (handoff `drain`), including
  those waiting for its blocks or their KV transfer. Requests placed on it whose prompt is still prefilling
  elsewhere (`Cluster.inbound`) are not waited for: their pickup reaches a switching worker, which refuses it,
  and the gateway has another decode worker pull the pinned KV (`Cluster._redirect`), as the real worker's drain
  counts only the calls it holds (services/worker.py `_held`).
- handoff `migrate` (services/role_switch.py): at each step boundary while it drains, the replica ends every stream
  whose first token went out; the gateway places it again at once, `prefer="local"` (a decode or `both` replica
  that prefills it itself), as prompt + the tokens sent with the rest of its output: that replica re-prefills
  them in its own scheduler (its prefix cache as usual), then decodes on. What has not emitted yet (prompts still
  prefilling elsewhere, transfers, allocations) arrives, commits, and leaves at the next boundary. The real
  gateway's reaction (an UNAVAILABLE, a Route, a Generate call: milliseconds) is not modelled.
- the switch itself: `switch_s` after the drain (measured: bench/role_switch.py, 0.31-0.33 s with nothing held;
  docs/planner.md). A new pod instead of a switch is the same path with the pod's start time in its place
  (`planner/switch_control.py` chooses by planner/switching.py's rule).
"""
from __future__ import annotations

from dataclasses import dataclass

SWITCHING = "switching"


@dataclass
class SwitchRecord:
    replica: str
    src: str
    dst: str
    decided: float               # virtual time the controller asked
    duration_s: float            # the switch's own time after the drain, or a new pod's start
    overlap: bool = False         # a new pod: its start runs beside the old one's drain (serving at
                                  # max(drained, decided + duration_s)); a switch: after it (drained + duration_s)
    drained: float | None = None
    serving: float | None = None  # registered in the new role (or back in the old one after a timeout)
    outcome: str = "draining"     # draining | switching | switched | drain_timeout

    @property
    def decision_to_serving_s(self) -> float | None:
        return None if self.serving is None else self.serving - self.decided


class SimSwitcher:
    """Switches replicas of a `Cluster` (one switch per replica at a time)."""

    def __init__(self, cluster, poll_s: float = 0.005, drain_timeout_s: float = 60.0, handoff: str = "drain"):
        if handoff not in ("drain", "migrate"):
            raise ValueError(f"handoff must be drain or migrate, not {handoff!r}")
        self.cluster = cluster
        self.poll_s = poll_s                   # how often a draining replica is checked (virtual seconds)
        self.drain_timeout_s = drain_timeout_s
        self.handoff = handoff
        self.handed_off = 0                    # streams moved by `migrate` handoffs
        self.records: list[SwitchRecord] = []
        self.active: dict[str, SwitchRecord] = {}
        self._queued: set[str] = set()         # replicas with a handoff waiting for their step boundary

    def start(self, rep, dst: str, duration_s: float, overlap: bool = False) -> SwitchRecord:
        if rep.name in self.active:
            raise ValueError(f"{rep.name} is already switching")
        if dst == rep.role or dst not in ("prefill", "decode"):
            raise ValueError(f"cannot switch {rep.name} from {rep.role} to {dst}")
        rec = SwitchRecord(rep.name, rep.role, dst, self.cluster.now, duration_s, overlap)
        self.records.append(rec)
        self.active[rep.name] = rec
        self.cluster.placer.withdraw(rep)
        self._capacity()
        self._check(rep, rec)
        return rec

    def drained(self, rep) -> bool:
        c = self.cluster
        return (not rep.busy and rep.outstanding() == 0 and not rep.remote_pending and not rep.core.pinned
                and not c.alloc_wait[rep.name])

    def _check(self, rep, rec: SwitchRecord) -> None:
        c = self.cluster
        if self.handoff == "migrate" and rep.reqs and rep.name not in self._queued:
            self._queued.add(rep.name)
            rep.call(self._hand_off, rep)  # at the step boundary, as the real stream ends after a message
        if self.drained(rep):
            rec.drained, rec.outcome = c.now, "switching"
            ready = max(c.now, rec.decided + rec.duration_s) if rec.overlap else c.now + rec.duration_s
            c._at(ready, self._register, rep, rec, rec.dst)
        elif c.now - rec.decided >= self.drain_timeout_s:
            rec.outcome = "drain_timeout"
            self._register(rep, rec, rec.src)
        else:
            c._at(c.now + self.poll_s, self._check, rep, rec)

    def _hand_off(self, rep) -> None:
        c = self.cluster
        self._queued.discard(rep.name)
        for req, sent in rep.hand_off():
            self.handed_off += 1
            mode, a, _ = c.placer.place(req, c.now, prefer="local", prompt=req.prompt + sent,
                                        max_tokens=req.output_len - len(sent))
            if mode != "colocated":  # no worker that prefills locally: the real gateway would fail the request
                req.state, req.error = "FAILED", "FAILED:no worker can take the migrated request"
                c._done(req)
                continue
            req.decode_replica = a.name
            a.call(a.add_resumed, req, sent, c.now)
            c._kick(a)

    def _register(self, rep, rec: SwitchRecord, role: str) -> None:
        rep.role = role
        self.cluster.placer.enroll(rep, role)
        rec.serving = self.cluster.now
        if rec.outcome == "switching":
            rec.outcome = "switched"
        del self.active[rep.name]
        self._capacity()
        self.cluster._kick(rep)

    def _capacity(self) -> None:
        """The gateway's admission reads the registry's decode pool: a switching worker is in no pool."""
        from pdserve.sim.admission import capacity_of
        c = self.cluster
        if c.admission is not None:
            c.admission.cap = capacity_of([r for r in c.replicas if r.name not in self.active]) or c.admission.cap

    def serving_counts(self) -> dict[str, int]:
        """Replicas placeable per pool now (a switching one counts in neither)."""
        out = {"prefill": 0, "decode": 0}
        for r in self.cluster.replicas:
            if r.name not in self.active and r.role in out:
                out[r.role] += 1
        return out
