"""Truncation filters and helpers used by the sampler.

The filters work in *sorted space*: each row's candidate tokens are laid out in
(-logit, token_id) order, with float64 weights w = exp((z - z_max) / T) (0 for
tokens no longer in the support) and a boolean `keep` mask.  Every filter
renormalises over the current support before applying its rule (spec §3.1: each
filter renormalises inside its kept set), so filter order matters ([D02]).

Totals are taken from `cumsum(...)[..., -1]` rather than `sum` on purpose: a
sequential scan gives the same bits for a row whatever the row width or the
rest of the batch, which is what makes seeded draws batch-invariant.
"""
from __future__ import annotations

import torch
from torch import Tensor

FILTERS = ("top_k", "top_p", "min_p", "typical_p")

# Cumulative mass within MASS_EPS of a threshold counts as having reached it. Logits arrive in
# float32 (relative error ~1e-7), so a finer distinction is noise; without this, an exact-boundary
# case such as spec [D01] typical_p=0.63 on [.02,.35,.33,.30] (0.30+0.33 == 0.63) would flip on
# the last bit of the softmax.
MASS_EPS = 1e-6


def _total(w: Tensor) -> Tensor:
    """Row totals [B, 1] by sequential scan (batch-invariant bits)."""
    return w.cumsum(-1)[..., -1:]


def top_k_keep(w: Tensor, keep: Tensor, k: Tensor) -> Tensor:
    """Keep the first k supported tokens in (-logit, id) order. k: [B] long (>= width: off)."""
    rank = keep.long().cumsum(-1)  # 1-based rank among the current support
    return keep & (rank <= k.unsqueeze(-1))


def top_p_keep(w: Tensor, keep: Tensor, p: Tensor, outside: Tensor | None = None) -> Tensor:
    """Smallest prefix (by probability, descending) whose mass first reaches >= p; boundary token kept.

    A token at sorted position j is kept iff the mass strictly before it is < p (up to MASS_EPS).
    p: [B] float64 (1.0: off — kept exactly, not subject to rounding of the cumulative sum).
    outside: [B] weight of supported tokens not laid out in `w` (candidate reduction), or None.
    """
    w = w * keep
    cum = w.cumsum(-1)
    # exclusive prefix mass, shifted rather than `cum - w` so the first token sees exactly 0
    before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)
    total = cum[..., -1:] if outside is None else cum[..., -1:] + outside.unsqueeze(-1)
    inside = before < (p.unsqueeze(-1) - MASS_EPS) * total
    inside |= keep & (keep.long().cumsum(-1) == 1)  # the most probable token is always kept
    return keep & (inside | (p >= 1.0).unsqueeze(-1))


def min_p_keep(w: Tensor, keep: Tensor, alpha: Tensor) -> Tensor:
    """Keep tokens with prob >= alpha * max prob (probabilities after temperature). alpha: [B] float64."""
    w = w * keep
    wmax = w.max(dim=-1, keepdim=True).values
    return keep & (w >= alpha.unsqueeze(-1) * wmax)


def typical_keep(w: Tensor, keep: Tensor, mass: Tensor) -> Tensor:
    """Locally typical sampling (Meister et al.): order tokens by |-log p_i - H(p)| ascending and keep
    the smallest prefix of that order whose mass first reaches >= mass. Ties in the distance keep
    the (-logit, id) order (stable sort). The result need not be a prefix by probability ([D01]).
    mass: [B] float64 (1.0: off)."""
    w = w * keep
    p = w / _total(w)
    logp = torch.where(keep, p.log(), torch.zeros_like(p))
    entropy = _total(-(p * logp))
    dist = torch.where(keep, (-logp - entropy).abs(), torch.full_like(p, float("inf")))
    order = torch.sort(dist, dim=-1, stable=True).indices
    p_ord = p.gather(-1, order)
    cum = p_ord.cumsum(-1)
    before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], dim=-1)
    inside_ord = before < (mass.unsqueeze(-1) - MASS_EPS) * cum[..., -1:]
    inside_ord[..., 0] = True  # the most typical supported token is always kept
    inside = torch.zeros_like(keep).scatter(-1, order, inside_ord)
    return keep & (inside | (mass >= 1.0).unsqueeze(-1))


def _order_key(x: Tensor) -> Tensor:
    """int64 keys whose descending order is the (-x, id) order of float32 rows: the float's bits made
    order-preserving as int32 (negative floats: all bits but the sign flipped), times 2^32, plus V-1-id. Keys are
    distinct, so `torch.topk` on them is exact and deterministic on every device."""
    V = x.shape[-1]
    bits = (x + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0: the two compare equal as floats
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    rev_id = (V - 1) - torch.arange(V, device=x.device, dtype=torch.int64)
    return ordered.to(torch.int64) * (1 << 32) + rev_id


def topk_exact(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k of each row of x [B, V] with ties broken by lowest token id, sorted by (-x, id).

    torch.topk does not promise which of several equal values it returns, so float32 rows are ranked by a
    composite integer key (value, then lower id) instead; other dtypes take a stable full sort. Neither reads
    anything back to the host (no data-dependent shapes), so this never synchronises with a device.
    Returns (values [B, k], indices [B, k])."""
    k = min(k, x.shape[-1])
    if x.dtype != torch.float32:
        vals, ids = sort_desc(x)
        return vals[:, :k], ids[:, :k]
    idx = torch.topk(_order_key(x), k, dim=-1, sorted=True).indices
    return x.gather(-1, idx), idx


def sort_desc(x: Tensor) -> tuple[Tensor, Tensor]:
    """Full sort by (-x, id)."""
    s = torch.sort(x, dim=-1, descending=True, stable=True)
    return s.values, s.indices
