"""Engine, part: the step. Schedule, one forward, sample (or verify, or beam-search) the rows that need a token,
commit them, fork extra branches on their first sample, and build each touched request's output."""
from __future__ import annotations

import time

import torch

from pdserve.engine import beam as beams
from pdserve.engine.host_copy import to_device
from pdserve.engine.outputs import CompletionOutput, Prefix, RequestOutput
from pdserve.engine.request import Request
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.sequence import Sequence
from pdserve.engine.stop import OutputProcessor


class EngineStep:
    """The step of `Engine` (engine.py), which sets the attributes used here."""

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    def drain_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside a step (aborts, a committed remote prefill's first token), without waiting
        for the next forward: the first token of a disaggregated request must not wait a decode step."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def step(self) -> list[RequestOutput]:
        """One scheduler step: schedule, one forward, sample (or verify, or beam-search) the rows that need a
        token, commit them; the outputs of every request it touched (and of those that ended meanwhile)."""
        self._expire(time.time())
        outputs = self.drain_outputs()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            beams.unstall([r.beam for r in self.requests.values() if r.beam is not None], self.scheduler)
            return outputs
        self._started(sched)
        want_prompt = {i for i, it in enumerate(sched.scheduled)
                       if it.seq.wants_prompt_logprobs and it.seq.num_output_tokens == 0}
        verifying = self.spec.begin(sched) if self.spec is not None else set()
        logits, owner = self.runner.execute(sched.scheduled, want_prompt | verifying)
        self.core.computed(sched)
        rows, seqs, spec_rows, beam_rows = self._rows(sched, owner, logits, want_prompt, verifying)
        # sampled where the logits are (the requests' generators live there too); the results cross in one copy
        sampled = logits
        if seqs and rows != list(range(logits.shape[0])):
            sampled = logits.index_select(0, to_device(rows, logits.device, torch.long))
        results = self.sampler.sample(sampled, [s.sampling for s in seqs]) if seqs else []
        if (spec_rows or beam_rows) and logits.device.type != "cpu":
            logits = logits.cpu()  # speculative verification and beam search choose their tokens on the host
        touched = self._commit(sched, seqs, results, spec_rows, beam_rows, logits)
        for req in touched.values():
            if req.finished:
                self._reclaim(req, S.FINISHED)
            outputs.append(self._output(req))
        return outputs

    def _started(self, sched) -> None:
        """Step statistics, and the first-scheduled time of the requests scheduled for the first time."""
        if self.config.fault_step_delay_s:  # fault injection: a slow device (docs/reliability.md)
            time.sleep(self.config.fault_step_delay_s)
        self.num_steps += 1
        self.batch_sizes.append((len(sched.scheduled), sched.num_batched_tokens))
        now = time.time()
        for item in sched.scheduled:
            req = self.requests[item.seq.request_id]
            if req.times.first_scheduled is None:
                req.times = req.times.scheduled_at(now)

    def _rows(self, sched, owner, logits, want_prompt: set[int], verifying: set[int]):
        """Which logits row does what: (rows to sample, their sequences, verifying item -> its k + 1 rows, beam
        request -> its (sequence, row)s). Prompt rows of a prompt-logprobs request are collected here. A request's
        first sample forks its extra branches, which share the prompt's blocks (and the row)."""
        rows, seqs = [], []
        spec_rows: dict[int, list[int]] = {}
        beam_rows: dict[str, list[tuple[Sequence, int]]] = {}  # beam search chooses its own tokens
        for row, (i, pos) in enumerate(owner):
            seq = sched.scheduled[i].seq
            if i in verifying:
                spec_rows.setdefault(i, []).append(row)
                continue
            if i in want_prompt and pos < seq.num_prompt_tokens - 1:
                self._collect_prompt_logits(seq, logits[row:row + 1])
                continue
            req = self.requests[seq.request_id]
            if req.beam is not None:
                beam_rows.setdefault(req.request_id, []).append((seq, row))
                continue
            rows.append(row)
            seqs.append(seq)
            if seq.branch == 0 and seq.num_output_tokens == 0 and len(req.seqs) < req.params.num_branches:
                for child in self._fork(req, seq, join=True):
                    rows.append(row)
                    seqs.append(child)
        return rows, seqs, spec_rows, beam_rows

    def _commit(self, sched, seqs, results, spec_rows, beam_rows, logits) -> dict[str, Request]:
        """Commit the sampled tokens, the speculative tokens verification accepted (rolling back the rest) and
        the beams' choices; returns the requests this touched."""
        touched: dict[str, Request] = {}
        now = time.time()
        for seq, res in zip(seqs, results):
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            req.times = req.times.first_token_at(now)
            if seq.sampling.params.logprobs is not None:
                seq.logprobs.append(res)
            self.core.commit(seq, res.token_id, req.prefill_only)
        for i, spec_row in spec_rows.items():
            seq = sched.scheduled[i].seq
            req = touched[seq.request_id] = self.requests[seq.request_id]
            verified = self.spec.finish(sched.scheduled[i], logits[spec_row], req.prefill_only)
            if seq.sampling.params.logprobs is not None:
                seq.logprobs.extend(verified)
        for rid, items in beam_rows.items():
            req = touched[rid] = self.requests[rid]
            req.times = req.times.first_token_at(now)
            live = beams.step(req.beam, [(seq, logits[row]) for seq, row in items], self.core,
                              lambda: next(self._seq_ids))
            if live:
                req.seqs = live
        return touched

    def _collect_prompt_logits(self, seq: Sequence, row: torch.Tensor) -> None:
        """Prompt logprobs need logits at every prompt position, gathered over the prefill chunks."""
        seq.prompt_logit_rows.append(row)
        if len(seq.prompt_logit_rows) == seq.num_prompt_tokens - 1:
            req = self.requests[seq.request_id]
            req.prompt_logprobs = self.sampler.prompt_logprobs(
                torch.cat(seq.prompt_logit_rows), req.prompt_token_ids, req.params.prompt_logprobs)
            seq.prompt_logit_rows = []

    def _fork(self, req: Request, parent: Sequence, join: bool) -> list[Sequence]:
        """The request's other branches, sharing `parent`'s blocks (before its first token: the prompt's)."""
        children = []
        for b in range(len(req.seqs), req.params.num_branches):
            child = Sequence(next(self._seq_ids), req.request_id, parent.token_ids, req.namespace, b,
                             parent.arrival_time)
            child.sampling = parent.sampling.fork(b)  # own RNG stream, forked grammar matcher
            child.output = OutputProcessor(req.params, self.tokenizer, self.eos_token_ids)
            if join:
                self.core.fork(parent, child)
            req.seqs.append(child)
            children.append(child)
        return children

    def _output(self, req: Request) -> RequestOutput:
        if req.beam is not None:
            return beams.output(req, self.tokenizer)
        # best_of > n: nothing was shown while it ran, so the chosen branches' "new" output is all of it
        whole = req.hides_branches()
        live = req.chosen() if whole else req.seqs
        outs = []
        for i, seq in enumerate(live):
            text = seq.output.text if hasattr(seq.output, "text") else seq.text
            done = seq.finished or whole  # running: cumulative ids and logprobs as prefixes, not copies (outputs.py)
            ids = seq.output_token_ids if done else Prefix(seq.token_ids, seq.num_prompt_tokens, seq.num_tokens)
            lps = None
            if seq.sampling.params.logprobs is not None:
                lps = list(seq.logprobs) if done else Prefix(seq.logprobs, 0, len(seq.logprobs))
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=ids, new_text=text if whole else seq.new_text,
                new_token_ids=list(ids) if whole else seq.new_token_ids, finish_reason=seq.finish_reason,
                cumulative_logprob=seq.sampling.cumulative_logprob, logprobs=lps))
        seqs = req.seqs
        for seq in seqs:
            seq.new_text, seq.new_token_ids = "", []
        finished = req.finished
        counts = req.token_counts()
        return RequestOutput(req.request_id, req.prompt_token_ids, outs, finished,
                             seqs[0].state.value if not finished else req.terminal_state().value,
                             seqs[0].num_cached_tokens, req.times, req.prompt_logprobs,
                             num_generated_tokens=counts[0], num_verified_tokens=counts[1],
                             num_accepted_tokens=counts[2], num_kv_growth_tokens=counts[3])
