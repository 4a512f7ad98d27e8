"""Per-request sampling parameters (OpenAI / vLLM meaning), validated before admission."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

MAX_REPETITION_PENALTY = 1e4  # far past any useful value (1.0 is off, 1.1-1.3 typical)

@dataclass
class GuidedSpec:
    """Constrained decoding request: exactly one of the fields is set."""

    json_schema: str | None = None  # JSON text of a schema
    json_object: bool = False  # any JSON object
    regex: str | None = None
    grammar: str | None = None  # EBNF (GBNF dialect, as xgrammar reads it)
    # json_schema and grammar together: the grammar's rule `json_root` is the schema's language (a tool call's
    # JSON inside the model's own call syntax, e.g. "<tool_call>\n" json_root "\n</tool_call>")


# Copies of one request (n, best_of): OpenAI's limit. Each copy is a sequence, a KV reservation share and, in
# disagg mode, an engine request on each side; one unbounded number must not fan out into thousands of them.
MAX_N = 128


class InvalidParameter(ValueError):
    """A request parameter the engine refuses; `param` names it (the gateway reports it as the OpenAI `param`,
    a worker sends it in the `pdserve-param` trailing metadata)."""

    def __init__(self, param: str, why: str):
        super().__init__(f"invalid sampling parameter '{param}': {why}")
        self.param, self.why = param, why


def _bad(name: str, why: str) -> None:
    raise InvalidParameter(name, why)


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    typical_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    no_repeat_ngram_size: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token (0: only the chosen one)
    prompt_logprobs: int | None = None
    logprobs_mode: Literal["raw", "processed"] = "raw"
    skip_special_tokens: bool = True
    guided: GuidedSpec | None = None
    # Beam search (engine/beam.py, transformers' semantics): width B >= 2 turns it on; `n` <= B best hypotheses
    # come back. length_penalty: score = sum of logprobs / length ** length_penalty. early_stopping: True, False
    # or "never", as transformers defines them.
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the offending field (the first, in this order)."""
        self._validate_counts()
        self._validate_filters(vocab_size)
        self._validate_penalties_and_logprobs()
        self._validate_ids_and_strings(vocab_size)

    def _validate_counts(self) -> None:
        bad = _bad
        if self.n < 1:
            bad("n", "must be >= 1")
        if self.n > MAX_N:
            bad("n", f"must be <= {MAX_N}")
        if self.best_of is not None and self.best_of < self.n:
            bad("best_of", "must be >= n")
        if self.best_of is not None and self.best_of > MAX_N:
            bad("best_of", f"must be <= {MAX_N}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "must be in [0, max_tokens]")

    def _validate_filters(self, vocab_size: int | None) -> None:
        bad = _bad
        if not (0.0 <= self.temperature < float("inf")):  # also rejects NaN
            bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            bad("top_k", "must be an integer")
        if not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            bad("top_k", "must be -1, 0 (off) or a positive count")
        if vocab_size is not None and self.top_k > vocab_size:
            bad("top_k", f"must be <= vocabulary size {vocab_size}")
        if not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1]")
        if not (0.0 < self.typical_p <= 1.0):
            bad("typical_p", "must be in (0, 1]")

    def _validate_penalties_and_logprobs(self) -> None:
        bad = _bad
        # bounded: the sampler scales logits by it in float32, where 3e38 is already infinite (and 0 * inf, NaN)
        if not (0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            bad("repetition_penalty", f"must be > 0 and <= {MAX_REPETITION_PENALTY:g}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            bad("frequency_penalty", "must be in [-2, 2]")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            bad("presence_penalty", "must be in [-2, 2]")
        if self.no_repeat_ngram_size < 0:
            bad("no_repeat_ngram_size", "must be >= 0")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", "must be in [0, 20]")
        if self.logprobs_mode not in ("raw", "processed"):
            bad("logprobs_mode", "must be 'raw' or 'processed'")

    def _validate_ids_and_strings(self, vocab_size: int | None) -> None:
        bad = _bad
        if vocab_size is not None:
            for name, ids in (
                ("logit_bias", list(self.logit_bias)),
                ("stop_token_ids", list(self.stop_token_ids)),
                ("allowed_token_ids", list(self.allowed_token_ids or [])),
            ):
                for tid in ids:
                    if not (0 <= int(tid) < vocab_size):
                        bad(name, f"token id {tid} outside [0, {vocab_size})")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            bad("allowed_token_ids", "must not be empty (no token could ever be sampled)")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            bad("seed", "must be in [0, 2**63)")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            bad("bad_words", "entries must be non-empty strings")
        if self.guided is not None:
            g = self.guided
            n_set = sum([g.json_schema is not None, bool(g.json_object), g.regex is not None, g.grammar is not None])
            wrapped = n_set == 2 and g.json_schema is not None and g.grammar is not None
            if n_set != 1 and not wrapped:
                bad("guided", "exactly one of json_schema, json_object, regex, grammar must be set")
        if self.beam_width is not None:
            self._validate_beam(_bad)
        for v in self.logit_bias.values():
            if not (-100.0 <= v <= 100.0):
                bad("logit_bias", "values must be in [-100, 100]")
        if any(not s for s in self.stop):
            bad("stop", "empty stop string")

    # Sampling knobs beam search does not combine with (it ranks whole sequences by log-probability; these would
    # change what is ranked). Temperature is ignored, as transformers ignores it without do_sample.
    _BEAM_EXCLUSIVE = (("best_of", None), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0), ("typical_p", 1.0),
                       ("min_tokens", 0), ("stop", []), ("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                       ("presence_penalty", 0.0), ("logit_bias", {}), ("allowed_token_ids", None), ("bad_words", []),
                       ("no_repeat_ngram_size", 0), ("logprobs", None), ("prompt_logprobs", None), ("guided", None))

    def _validate_beam(self, bad) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            bad("beam_width", "must be a positive integer")
        if self.beam_width > MAX_N:
            bad("beam_width", f"must be <= {MAX_N}")
        if self.n > self.beam_width:
            bad("n", "must be <= beam_width (the n best of the beam_width hypotheses are returned)")
        if not (-float("inf") < self.length_penalty < float("inf")):
            bad("length_penalty", "must be a finite number")
        if self.early_stopping not in (True, False, "never"):
            bad("early_stopping", "must be true, false or \"never\"")
        for name, off in self._BEAM_EXCLUSIVE:
            value = getattr(self, name)
            if value != off and not (name == "top_k" and value == -1):
                bad(name, "is not supported with beam search (beam_width)")

    @property
    def beam(self) -> bool:
        return self.beam_width is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_branches(self) -> int:
        """Sequences the request runs at once (what admission reserves KV for): beams, else best_of or n."""
        return self.beam_width or self.best_of or self.n
