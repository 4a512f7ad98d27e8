"""Resuming a migrated request: a sequence that continues after output tokens sampled by another engine.

The gateway migrates a request whose worker died mid-stream (docs/reliability.md, "Mid-stream migration"): the
new worker gets the prompt and the tokens the client already has. `replay` puts the sequence where the dead
worker's was after those tokens, so that the next token is the one it would have sampled:

  * the sequence holds prompt + output and no KV: the scheduler prefills all of it (the prefix cache serves what
    it can), exactly as it recomputes a sequence preempted by recompute; `num_prompt_tokens` stays the prompt's,
    so the tokens count as output (max_tokens, min_tokens, the context limit);
  * the sampling state appends each token (penalty counts: frequency / presence see them as output tokens,
    repetition and no-repeat n-grams as history; bad-word suffixes; the grammar matcher advances);
  * the generator draws once per token for T > 0 (the sampler's one uniform per sampled row, `skip_draw`), so a
    seeded request continues the same random stream: draw k+1 is the next token's, as on the dead worker;
  * the output processor steps through the tokens (detokenizer window, stop-string hold-back, the min_tokens
    count) and its text is marked sent: the old worker streamed exactly the text it emits for those tokens,
    the step-by-step processing being a function of the tokens alone.

Not replayed: `cumulative_logprob` (best_of ranks by it; the gateway migrates single-branch requests only) and
the logprobs of the replayed tokens (the client has them).
"""
from __future__ import annotations

from pdserve.engine.sampler import Sampler
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence


def check(params: SamplingParams, prefill_only: bool) -> None:
    """Only a single-branch request resumes (the gateway migrates no other; `replay` restores one branch, not
    best_of's ranking or a beam search), on a worker that decodes."""
    if params.num_branches != 1 or prefill_only or params.beam:
        raise ValueError("invalid resume: only a single-branch request resumes, on a worker that decodes")


def resume(seq: Sequence, output_token_ids: list[int], vocab_size: int, max_model_len: int,
           predicted_output_tokens: int | None) -> int | None:
    """`replay`, and no prompt logprobs again: the client has them from the first worker. Returns the output
    tokens still predicted: the caller's prediction counted the resumed ones too."""
    replay(seq, list(output_token_ids), vocab_size, max_model_len)
    seq.wants_prompt_logprobs = False
    if predicted_output_tokens is None:
        return None
    return max(0, predicted_output_tokens - len(output_token_ids))


def replay(seq: Sequence, output_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Advance a fresh (queued, no KV) single-branch sequence past `output_token_ids`. Raises ValueError when they
    cannot be a live request's output: an id outside the vocabulary, no room left in the context, or a token
    that already ends the request (the client would have had the end)."""
    if any(not (0 <= t < vocab_size) for t in output_token_ids):
        raise ValueError("invalid resume: token id outside the vocabulary")
    if seq.num_tokens + len(output_token_ids) >= max_model_len:
        raise ValueError(f"invalid resume: prompt + {len(output_token_ids)} output tokens leave no room in the "
                         f"context of {max_model_len} tokens")
    st, out = seq.sampling, seq.output
    for i, t in enumerate(output_token_ids):
        Sampler.skip_draw(st)
        st.append(t)
        seq.token_ids.append(t)
        _, reason = out.step(t, st)
        if reason is not None:
            raise ValueError(f"invalid resume: output token {i} already ends the request ({reason})")
