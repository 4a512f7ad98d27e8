"""Placement policies by name: a deployment (`pdserve router --placement NAME`) and the simulator
(`RouterSpec.policy`, `pdserve sim run --router-policy NAME`) select one from this table.

Built in: `cache-aware` (cache_aware.py, the router's cost model; the default), and the baselines it is measured
against, `round-robin` and `least-loaded` (baselines.py). The simulator adds `oracle` (sim/baselines.py), which
reads the replicas' exact cache state and so cannot run in a deployment (`sim_only`).

A new policy is a class with `place(workers, *, req) -> Placement` (placement.py) and one `register` call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pdserve.services.router.baselines import LeastLoaded, RoundRobin
from pdserve.services.router.cache_aware import Policy
from pdserve.services.router.cost import CostParams
from pdserve.services.router.placement import PlacementPolicy, PolicyContext

Factory = Callable[[PolicyContext], PlacementPolicy]


@dataclass(frozen=True)
class Registered:
    factory: Factory
    sim_only: bool = False  # needs PolicyContext.replicas, which only the simulator has


PLACEMENT_POLICIES: dict[str, Registered] = {}


def register(name: str, factory: Factory, *, sim_only: bool = False) -> None:
    if name in PLACEMENT_POLICIES:  # a silent replace would change what a deployment's name means
        raise ValueError(f"placement policy {name!r} is already registered")
    PLACEMENT_POLICIES[name] = Registered(factory, sim_only)


def names(sim: bool = False) -> list[str]:
    """The names a deployment may select; with `sim`, also those only the simulator can run."""
    return [n for n, r in PLACEMENT_POLICIES.items() if sim or not r.sim_only]


def create(name: str, ctx: PolicyContext) -> PlacementPolicy:
    in_sim = ctx.replicas is not None
    entry = PLACEMENT_POLICIES.get(name)
    if entry is None or (entry.sim_only and not in_sim):
        why = " (it needs the simulator's replicas)" if entry is not None else ""
        raise ValueError(f"unknown placement policy {name!r}{why}: choose one of {', '.join(names(in_sim))}")
    return entry.factory(ctx)


def _cache_aware(ctx: PolicyContext) -> Policy:
    params = CostParams() if ctx.local_stall_steps is None else CostParams(local_stall_steps=ctx.local_stall_steps)
    return Policy(ctx.mode, ctx.index, params, rng=ctx.rng, clock=ctx.clock, weights=ctx.weights)


register("cache-aware", _cache_aware)
register("round-robin", lambda ctx: RoundRobin())
register("least-loaded", lambda ctx: LeastLoaded(ctx.rng, ctx.clock))
