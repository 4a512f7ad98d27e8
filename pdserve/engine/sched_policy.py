"""Scheduling policies: how one scheduler tick orders its queues (scheduler.py runs the tick).

A policy is looked up by name once, when the scheduler is built (`EngineConfig.policy`, `--policy`), and answers
three questions each tick:
- `running_order`: the running sequences, oldest first as given, in the order they get this tick's budget;
- `prefill_first`: whether running prefills and the queue take the budget before running decodes do;
- `waiting_order`: the queued sequences in admission order.

`fcfs`, `decode-priority` and `prefill-priority` admit in arrival order (recompute-preempted sequences were put
at the front of the queue). `priority` admits by (priority class, arrival), `shortest-predicted-first` by
predicted remaining work in ticks; both put any request queued longer than `starvation_age_s` first, in arrival
order: the age bound is what keeps long / low-class requests from starving.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable, Protocol

if TYPE_CHECKING:
    from pdserve.engine.sequence import Sequence


class SchedulingPolicy(Protocol):
    name: str
    prefill_first: bool

    def running_order(self, by_age: list[Sequence]) -> list[Sequence]: ...

    def waiting_order(self, waiting: Iterable[Sequence], chunk: int, starvation_age_s: float) -> list[Sequence]: ...


class Fcfs:
    name = "fcfs"
    prefill_first = False

    def running_order(self, by_age: list[Sequence]) -> list[Sequence]:
        return by_age

    def waiting_order(self, waiting: Iterable[Sequence], chunk: int, starvation_age_s: float) -> list[Sequence]:
        return list(waiting)


class DecodePriority(Fcfs):
    """Running decodes get the budget before running prefills: inter-token latency over new prompts."""
    name = "decode-priority"

    def running_order(self, by_age: list[Sequence]) -> list[Sequence]:
        return [s for s in by_age if not s.is_prefill] + [s for s in by_age if s.is_prefill]


class PrefillPriority(Fcfs):
    """New prompts (running prefills, then the queue) go before running decodes, which get what is left."""
    name = "prefill-priority"
    prefill_first = True

    def running_order(self, by_age: list[Sequence]) -> list[Sequence]:
        return [s for s in by_age if s.is_prefill] + [s for s in by_age if not s.is_prefill]


class Priority(Fcfs):
    """Admit by `rank` (here the priority class; lower first), then arrival; starved requests first."""
    name = "priority"

    def rank(self, s: Sequence, chunk: int) -> float:
        return float(s.priority)

    def waiting_order(self, waiting: Iterable[Sequence], chunk: int, starvation_age_s: float) -> list[Sequence]:
        now = time.time()

        def key(s: Sequence) -> tuple:
            if now - s.arrival_time > starvation_age_s:
                return (0, 0.0, s.arrival_time, s.seq_id)
            return (1, self.rank(s, chunk), s.arrival_time, s.seq_id)

        return sorted(waiting, key=key)


class ShortestPredictedFirst(Priority):
    """Rank by predicted ticks left: output tokens still predicted plus prompt chunks still to compute."""
    name = "shortest-predicted-first"

    def rank(self, s: Sequence, chunk: int) -> float:
        work = max(0, s.predicted_output_tokens - s.num_output_tokens) + (s.num_tokens - s.num_computed_tokens) / chunk
        return float(work)


SCHEDULING_POLICIES: dict[str, SchedulingPolicy] = {
    p.name: p for p in (Fcfs(), DecodePriority(), PrefillPriority(), Priority(), ShortestPredictedFirst())}


def scheduling_policy(name: str) -> SchedulingPolicy:
    try:
        return SCHEDULING_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r} (one of {', '.join(SCHEDULING_POLICIES)})") from None
