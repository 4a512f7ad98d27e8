"""Per-sequence output processing: detokenize, detect stop conditions, decide what is safe to stream.

Finish reasons (OpenAI names):
  "stop"   - EOS (unless ignore_eos), a stop_token_id, a stop string, the grammar terminated,
             or a sampling dead end (see sampler docs);
  "length" - max_tokens reached (the engine enforces the context limit and calls `finish`).
Precedence within one step: EOS / stop token > grammar > stop string > length.
min_tokens: no stop condition (token or string) fires while fewer than min_tokens tokens have
been generated; the sampler also masks EOS / stop tokens until then.
Text of the EOS / stop token itself is not emitted (a stop token's text is when
include_stop_str_in_output). A matched stop string is cut off, or kept with
include_stop_str_in_output.

Streaming safety (spec §3.4, [D03]): any tail of the text that is a prefix of some stop string is
held back; it is released as soon as it can no longer start a match, or at the end. Hence no
streamed text is ever part of a stop string that matches later, and with no match the
concatenation of all deltas equals the full decoded text.

Counts for usage records: `num_generated` = tokens sampled; `num_emitted` = tokens whose whole
text has reached the client (tokens dropped by a stop match, or the stopping EOS / stop token,
are generated but not emitted). "Committed" (KV kept) is the engine's count.
"""
from __future__ import annotations

from bisect import bisect_right

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sampling_state import SamplingState


class OutputProcessor:
    def __init__(self, params: SamplingParams, tokenizer, eos_token_ids: list[int]):
        self.params = params
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids)
        self.stops = list(params.stop)
        self.detok: IncrementalDetokenizer | None = None
        self.text = ""  # all text decoded so far (before any stop truncation)
        self.emitted_len = 0  # characters of self.text already returned to the caller
        self.finish_reason: str | None = None
        self.num_generated = 0
        self._tok_end: list[int] = []  # text length once each (resolved) token's text was complete
        self._unresolved = 0  # tokens whose text is still incomplete (held by the detokenizer)

    @property
    def num_emitted(self) -> int:
        return bisect_right(self._tok_end, self.emitted_len)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def step(self, token_id: int, state: SamplingState) -> tuple[str, str | None]:
        """Process one sampled token; returns (text delta safe to stream, finish_reason or None)."""
        if self.finished:
            raise RuntimeError("step() after the sequence finished")
        if self.detok is None:
            self.detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, self.params.skip_special_tokens)
        p = self.params
        self.num_generated += 1
        stops_allowed = self.num_generated > p.min_tokens  # this token may itself be a stop token
        reason, keep_text = None, True
        if state.dead_end:
            reason, keep_text = "stop", False
        elif stops_allowed and token_id in self.eos_token_ids and not p.ignore_eos:
            reason, keep_text = "stop", False
        elif stops_allowed and token_id in self.stop_token_ids:
            reason, keep_text = "stop", p.include_stop_str_in_output

        prev_len = len(self.text)
        if keep_text:
            self._add_text(self.detok.step(token_id))
        if reason is None and state.grammar_terminated:
            reason = "stop"
        cut = None
        if reason is None and self.stops and self.num_generated >= p.min_tokens:
            cut = self._find_stop(prev_len)
            if cut is not None:
                reason = "stop"
        if reason is None and p.max_tokens is not None and self.num_generated >= p.max_tokens:
            reason = "length"
        if reason is not None:
            return self._finish(reason, cut), reason
        safe = len(self.text) - self._held_back()
        return self._emit_to(safe), None

    def flush(self) -> str:
        """Release everything held back (no stop string can match any more)."""
        if self.finished or self.detok is None:
            return ""
        self._add_text(self.detok.flush(), final=True)
        return self._emit_to(len(self.text))

    def finish(self, reason: str) -> str:
        """End the sequence for an engine-side reason (e.g. "length" at the context limit)."""
        delta = self.flush()
        self.finish_reason = self.finish_reason or reason
        return delta

    # ------------------------------------------------------------------------------------------
    def _add_text(self, delta: str, final: bool = False) -> None:
        """Append decoded text. A step (final=False) carries one new token; a token whose bytes are
        still incomplete gets its end position once later text arrives (or at the final flush)."""
        self.text += delta
        if not final:
            self._unresolved += 1
        if delta or final:
            self._tok_end.extend([len(self.text)] * self._unresolved)
            self._unresolved = 0

    def _find_stop(self, prev_len: int) -> int | None:
        """Earliest stop-string match that ends in the newly added text; returns the output cut."""
        best: tuple[int, int] | None = None
        for s in self.stops:
            i = self.text.find(s, max(0, prev_len - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, len(s))
        if best is None:
            return None
        return best[0] + (best[1] if self.params.include_stop_str_in_output else 0)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        n = 0
        for s in self.stops:
            for L in range(min(len(s) - 1, len(self.text)), n, -1):
                if self.text.endswith(s[:L]):
                    n = L
                    break
        return n

    def _emit_to(self, end: int) -> str:
        if end <= self.emitted_len:
            return ""
        delta = self.text[self.emitted_len : end]
        self.emitted_len = end
        return delta

    def _finish(self, reason: str, cut: int | None) -> str:
        self.finish_reason = reason
        if cut is None:  # no stop string: everything decoded is final, including held bytes
            self._add_text(self.detok.flush(), final=True)
            cut = len(self.text)
        return self._emit_to(cut)
