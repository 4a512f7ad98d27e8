"""Tenant KV shares (spec §1.2 "租户配额", §5.5, Q22; docs/admission.md "Tenant KV shares"): what a tenant is
guaranteed and may borrow, and the rule the reservation ledger applies (`reservations.RESERVE_LUA` does the same
arithmetic in Redis; `LocalLedger` calls these functions).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVShare:
    """A tenant's KV share as the ledger applies it (from the keys file: `kv_share`, `kv_max_share`,
    `kv_idle_s`; tenants.py)."""
    tenant: str = ""
    guaranteed: float = 0.0  # fraction of the capacity held back for it while it is active
    max_share: float = 1.0   # the most it may hold, borrowing included
    idle_s: float = 30.0     # active this long after its last request (or while it holds a reservation)


NO_SHARE = KVShare()


def fair_free(cap_blocks: int, used_by: dict[str, int], guarantees: dict[str, float], active: set[str],
              me: KVShare) -> int:
    """The blocks `me` may still reserve (RESERVE_LUA's rule, reservations.py's module doc): the capacity less
    what is reserved and what active others are still owed of their guarantees, and no more than its cap leaves."""
    owed = 0
    for u in active | {u for u, b in used_by.items() if b > 0}:
        if u != me.tenant:
            owed += max(0, math.floor(guarantees.get(u, 0.0) * cap_blocks) - used_by.get(u, 0))
    used = sum(used_by.values())
    return min(cap_blocks - used - owed, math.floor(me.max_share * cap_blocks) - used_by.get(me.tenant, 0))


def fair_slots(cap_seqs: int, n_by: dict[str, int], guarantees: dict[str, float], active: set[str],
               me: KVShare) -> int:
    """The sequence slots `me` may still take: the same guarantee rule over requests instead of blocks (a
    noisy tenant of many small requests cannot fill the slots an active tenant's share holds back)."""
    owed = 0
    for u in active | {u for u, c in n_by.items() if c > 0}:
        if u != me.tenant:
            owed += max(0, math.floor(guarantees.get(u, 0.0) * cap_seqs) - n_by.get(u, 0))
    return cap_seqs - sum(n_by.values()) - owed
