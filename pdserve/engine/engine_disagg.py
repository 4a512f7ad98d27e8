"""Engine, part: the disaggregation hooks. Prefill side: the pinned KV of a prefilled request and its release;
decode side: blocks allocated for a prompt prefilled elsewhere, committed (or failed) once its KV arrived."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.engine.outputs import FirstToken
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import InvalidParameter, SamplingParams

if TYPE_CHECKING:  # xgrammar (and the transformers it imports) loads on the first constrained request
    from xgrammar import CompiledGrammar


class EngineDisagg:
    """Disaggregation hooks of `Engine` (engine.py), which sets the attributes used here."""

    def pinned_kv(self, request_id: str) -> tuple[list[int], int]:
        return self.core.pinned_kv(request_id)

    def release_pinned(self, request_id: str) -> None:
        self.core.release_pinned(request_id)

    def discard(self, request_id: str) -> None:
        """Prefill side, the caller is gone: end the request CANCELLED wherever it is (still prefilling: aborted;
        prefilled, its KV pinned but handed to nobody: released). Idempotent; unknown ids are a no-op."""
        self.abort(request_id, "CANCELLED")
        self.release_pinned(request_id)

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], first_tokens: list[FirstToken],
                              params: SamplingParams, *, namespace: str = "",
                              arrival_time: float | None = None, deadline: float | None = None,
                              priority: int = 0, transfer_deadline: float | None = None,
                              grammar: CompiledGrammar | None = None) -> tuple[list[int], int] | None:
        """Decode side: allocate blocks for a prompt prefilled elsewhere, once for all branches. `first_tokens`:
        each branch's first token (branch i = entry i; n, or best_of of them), sampled by the prefill worker.
        Returns (block ids, number of leading blocks already valid from the local prefix cache) or None when the
        blocks cannot be had now.
        `transfer_deadline` (unix time): not committed by then, the request ends FAILED (`expire_transfers`)."""
        if request_id in self.requests or request_id in self.remote_pending:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validate_request(prompt_token_ids, params)
        if params.beam:
            raise InvalidParameter("beam_width", "beam search runs on a colocated worker, not from a remote prefill")
        if len(first_tokens) != params.num_branches:
            raise ValueError(f"invalid first tokens: {len(first_tokens)} for {params.num_branches} branches")
        if any(not (0 <= f.token_id < self.model_config.vocab_size) for f in first_tokens):
            raise ValueError("invalid first tokens: token id outside the vocabulary")
        req = self._new_request(request_id, prompt_token_ids, params, namespace, arrival_time, grammar)
        self._lifecycle(req, deadline, priority, None)
        seq = req.seqs[0]
        hits = self.core.allocate_prefilled(seq, reuse=not self.config.no_decode_prefix_reuse)
        if hits is None:
            return None
        req.first_tokens = list(first_tokens)
        req.transfer_deadline = transfer_deadline
        self.remote_pending[request_id] = req
        return list(seq.block_table), hits

    def commit_prefilled(self, request_id: str) -> bool:
        """The transferred blocks hold the prompt's KV: the branches fork from it (sharing its blocks), each
        appends its own first token and joins the decode batch.
        False when the request is no longer pending (its transfer deadline passed, or it was aborted)."""
        req = self.remote_pending.pop(request_id, None)
        if req is None:
            return False
        self._fork(req, req.seqs[0], join=False)
        for seq, first in zip(req.seqs, req.first_tokens, strict=True):
            Sampler.skip_draw(seq.sampling)  # the first token was drawn on the prefill worker
            seq.sampling.append(first.token_id)
            seq.sampling.cumulative_logprob = first.cumulative_logprob
            if seq.sampling.params.logprobs is not None and first.logprobs is not None:
                seq.logprobs.append(first.logprobs)
        req.times = req.times.first_token_at(time.time())
        self.requests[request_id] = req
        reasons = self.core.commit_prefilled(req.seqs, [f.token_id for f in req.first_tokens])
        if all(r is not None for r in reasons):
            self._reclaim(req, S.FINISHED)
        self._pending_outputs.append(self._output(req))
        return True

    def fail_prefilled(self, request_id: str) -> None:
        self.abort(request_id, "FAILED")

    def has_pending_transfers(self) -> bool:
        return bool(self.remote_pending)

    def drain_kv_events(self) -> list:
        """Block stored/evicted events since the last call (for the router's prefix index)."""
        events = list(self.block_manager.events)
        self.block_manager.events.clear()
        return events
