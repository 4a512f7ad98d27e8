"""Minimal output processor (EOS, stop token ids, max_tokens); the full stop/detokenize pipeline replaces it."""
from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams


class OutputProcessor:
    def __init__(self, params: SamplingParams, tokenizer, eos_token_ids: list[int]):
        self.params = params
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        self.ids: list[int] = []
        self.text = ""
        self.num_generated = 0
        self.num_emitted = 0

    def step(self, token_id: int, state) -> tuple[str, str | None]:
        p = self.params
        self.num_generated += 1
        reason = None
        if not p.ignore_eos and token_id in self.eos or token_id in p.stop_token_ids:
            reason = "stop"
        else:
            self.ids.append(token_id)
        if reason is None and p.max_tokens is not None and self.num_generated >= p.max_tokens:
            reason = "length"
        text = self.tokenizer.decode(self.ids, skip_special_tokens=p.skip_special_tokens)
        delta, self.text = text[len(self.text):], text
        self.num_emitted = len(self.ids)
        return delta, reason

    def flush(self) -> str:
        return ""
