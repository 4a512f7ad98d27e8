"""Engine, part: a request in. Validation before anything is held, the request and its first sequence (sampling
state, grammar, stop processor), deadline / priority / predicted length, and the hand-off to the scheduler."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.engine import beam as beams
from pdserve.engine import resume
from pdserve.engine.errors import RequestRejected
from pdserve.engine.grammar import make_grammar_state
from pdserve.engine.outputs import RequestTimes
from pdserve.engine.request import Request
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.sampler import SamplingState, bad_words_to_ids
from pdserve.engine.sampling_params import InvalidParameter, SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.engine.stop import OutputProcessor

if TYPE_CHECKING:  # xgrammar (and the transformers it imports) loads on the first constrained request
    from xgrammar import CompiledGrammar


class EngineAdmit:
    """Admission of `Engine` (engine.py), which sets the attributes used here."""

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (bad parameters) or RequestRejected (can never be served) before anything is held."""
        params.validate(self.model_config.vocab_size)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("invalid prompt: it tokenizes to zero tokens")
        if any(not (0 <= t < self.model_config.vocab_size) for t in prompt_token_ids):
            raise ValueError("invalid prompt: token id outside the vocabulary")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"prompt has {n} tokens; this model's context is {self.max_model_len} tokens including output")
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            raise RequestRejected(f"prompt has {n} tokens, more than max_num_batched_tokens "
                                  f"{self.config.max_num_batched_tokens} with chunked prefill off")
        if self.block_manager.blocks_needed(n + 1) > self.block_manager.num_blocks:
            raise RequestRejected(f"prompt of {n} tokens needs more KV blocks than this worker has")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    namespace: str = "", prefill_only: bool = False, arrival_time: float | None = None,
                    deadline: float | None = None, priority: int = 0,
                    predicted_output_tokens: int | None = None, resume_token_ids: list[int] | None = None,
                    grammar: CompiledGrammar | None = None) -> None:
        """`deadline` (unix time): TIMED_OUT when passed; `priority` (lower = more urgent) and
        `predicted_output_tokens` feed the `priority` / `shortest-predicted-first` policies. `resume_token_ids`:
        a migrated request continues after these output tokens (engine/resume.py; one branch, not prefill-only).
        `grammar`: `params.guided` compiled off this thread (grammar_pool.py); None compiles it here."""
        if request_id in self.requests or request_id in self.remote_pending:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validate_request(prompt_token_ids, params)
        if resume_token_ids:
            resume.check(params, prefill_only)
        req = self._new_request(request_id, prompt_token_ids, params, namespace, arrival_time, grammar)
        req.prefill_only = prefill_only
        if resume_token_ids:
            predicted_output_tokens = resume.resume(req.seqs[0], resume_token_ids, self.model_config.vocab_size,
                                                    self.max_model_len, predicted_output_tokens)
            self.validate_request(req.seqs[0].token_ids, params)  # prompt + output must fit as a prefill does
        if params.beam:
            if prefill_only:
                raise InvalidParameter("beam_width", "beam search runs where the whole request runs (a colocated "
                                       "worker), not split into prefill and decode")
            req.beam = beams.start(params, len(req.prompt_token_ids), self.max_model_len, self.eos_token_ids,
                                   req.seqs[0])
        self._lifecycle(req, deadline, priority, predicted_output_tokens)
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])

    def _lifecycle(self, req: Request, deadline: float | None, priority: int, predicted: int | None) -> None:
        req.deadline = deadline
        seq = req.seqs[0]
        seq.priority = int(priority)
        if predicted is None:
            mt = req.params.max_tokens
            predicted = mt if mt is not None else self.max_model_len - len(req.prompt_token_ids)
        seq.predicted_output_tokens = int(predicted)

    def _new_request(self, request_id, prompt_token_ids, params, namespace, arrival_time,
                     compiled: CompiledGrammar | None = None) -> Request:
        arrival = arrival_time if arrival_time is not None else time.time()
        seq = Sequence(next(self._seq_ids), request_id, prompt_token_ids, namespace, 0, arrival)
        grammar = make_grammar_state(params.guided, self.tokenizer, self.model_config.vocab_size, compiled) \
            if params.guided is not None else None
        seq.sampling = SamplingState(params, list(prompt_token_ids), self.model_config.vocab_size,
                                     self.eos_token_ids, grammar, 0,
                                     bad_words_ids=bad_words_to_ids(params.bad_words, self.tokenizer),
                                     device=self.runner.device)
        seq.output = OutputProcessor(params, self.tokenizer, self.eos_token_ids)
        seq.wants_prompt_logprobs = params.prompt_logprobs is not None
        seq.set_state(S.QUEUED)
        return Request(request_id, list(prompt_token_ids), params, namespace, [seq], RequestTimes(arrival, time.time()))
