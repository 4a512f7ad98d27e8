"""Every request field the OpenAI endpoints accept, in one table.

A field not in the table is a 400 naming it (OpenAI's own answer to an unknown argument); an OpenAI field pdserve
does not implement is in `UNSUPPORTED` and is a 400 saying so, unless its value is the one that changes nothing.
The same table is the request schema of `/openapi.json` (openapi.py) and is documented in docs/api.md
(tests/services/gateway/test_fields.py keeps the two in step). The values themselves are checked in parse.py
and params.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sampling_params import MAX_REPETITION_PENALTY
from pdserve.services.gateway.params import INT32_MAX, MAX_N, bad

COMPLETIONS, CHAT = "completions", "chat"
MAX_PRIORITY = 1000
BOTH = (COMPLETIONS, CHAT)

_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_STRS = {"type": "array", "items": {"type": "string"}}


@dataclass(frozen=True)
class Field:
    name: str
    schema: dict  # JSON schema of the value (null is always accepted and means the default)
    doc: str
    endpoints: tuple[str, ...] = BOTH
    extension: bool = False  # pdserve's (vLLM-style), not OpenAI's
    required: bool = False
    extra: dict = field(default_factory=dict)


FIELDS: list[Field] = [
    # ---- OpenAI's ----
    Field("model", _STR, "the served model name (404 for another)"),
    Field("prompt", {"oneOf": [_STR, _STRS, _IDS, {"type": "array", "items": _IDS}]},
          "text, texts, token ids or lists of token ids (at most 1024 prompts)", (COMPLETIONS,), required=True),
    Field("messages", {"type": "array", "items": {"type": "object"}},
          "roles system, developer, user, assistant, tool; content a string or text parts", (CHAT,), required=True),
    Field("stream", _BOOL, "server-sent events"),
    Field("stream_options", {"type": "object", "properties": {"include_usage": _BOOL, "include_obfuscation": _BOOL},
                             "additionalProperties": False},
          "`include_usage`: a last chunk with usage; `include_obfuscation`: accepted, nothing is padded"),
    Field("n", {**_INT, "minimum": 1, "maximum": MAX_N}, "choices per prompt"),
    Field("best_of", {**_INT, "minimum": 1, "maximum": MAX_N},
          ">= n; above n: the n of highest cumulative log-prob, returned at the end (400 with stream)",
          (COMPLETIONS,)),
    Field("echo", _BOOL, "the prompt before the completion (not with stream)", (COMPLETIONS,)),
    Field("max_tokens", {**_INT, "minimum": 0, "maximum": INT32_MAX},
          "prompt + max_tokens must fit the context (else 400); 0 only with echo"),
    Field("max_completion_tokens", {**_INT, "minimum": 1, "maximum": INT32_MAX}, "as max_tokens; wins over it",
          (CHAT,)),
    Field("temperature", {**_NUM, "minimum": 0}, "0 is greedy"),
    Field("top_p", {**_NUM, "exclusiveMinimum": 0, "maximum": 1}, "nucleus sampling"),
    Field("seed", {**_INT, "minimum": 0, "maximum": 2**63 - 1}, "reproducible sampling"),
    Field("stop", {"oneOf": [_STR, {**_STRS, "maxItems": 16}]}, "stop strings (cut from the text)"),
    Field("presence_penalty", {**_NUM, "minimum": -2, "maximum": 2}, ""),
    Field("frequency_penalty", {**_NUM, "minimum": -2, "maximum": 2}, ""),
    Field("logit_bias", {"type": "object", "additionalProperties": {**_NUM, "minimum": -100, "maximum": 100}},
          "token id (a decimal string) -> bias in [-100, 100]"),
    Field("logprobs", {"oneOf": [_BOOL, {**_INT, "minimum": 0, "maximum": 20}]},
          "completions: an integer in [0, 20]; chat: a boolean"),
    Field("top_logprobs", {**_INT, "minimum": 0, "maximum": 20}, "with logprobs: true", (CHAT,)),
    Field("response_format", {"type": "object"}, "`text`, `json_object`, `json_schema`"),
    Field("user", _STR, "accepted and not used"),
    Field("safety_identifier", _STR, "as `user`: accepted and not used"),
    Field("prompt_cache_key", _STR, "accepted; requests sharing a prompt prefix already go where it is cached (the "
                                    "router's prefix index), so the key adds nothing"),
    Field("tools", {"type": "array", "items": {"type": "object"}, "minItems": 1, "maxItems": 128},
          "function tools (`{type: function, function: {name, description, parameters}}`), given to the chat "
          "template", (CHAT,)),
    Field("tool_choice", {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
          "`required` and `{type: function, function: {name}}` are enforced by a grammar", (CHAT,)),
    Field("parallel_tool_calls", _BOOL, "false: at most one call", (CHAT,)),
    # ---- pdserve's extensions ----
    Field("top_k", {**_INT, "minimum": -1}, "-1 or 0: off; at most the vocabulary size", extension=True),
    Field("min_p", {**_NUM, "minimum": 0, "maximum": 1}, "", extension=True),
    Field("typical_p", {**_NUM, "exclusiveMinimum": 0, "maximum": 1}, "locally typical sampling; 1: off",
          extension=True),
    Field("repetition_penalty", {**_NUM, "exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY}, "1: off",
          extension=True),
    Field("no_repeat_ngram_size", {**_INT, "minimum": 0, "maximum": INT32_MAX}, "0: off", extension=True),
    Field("min_tokens", {**_INT, "minimum": 0}, "EOS and stop tokens masked until then; <= max_tokens",
          extension=True),
    Field("ignore_eos", _BOOL, "keep sampling past EOS", extension=True),
    Field("beam_width", {**_INT, "minimum": 1, "maximum": MAX_N},
          "beam search with this many beams (transformers' semantics; the n best come back at the end; a `both` "
          "worker; not with sampling filters, penalties, stop strings, logprobs or guided output)", extension=True),
    Field("length_penalty", _NUM, "beam search: score = sum of logprobs / length ** length_penalty (default 1)",
          extension=True),
    Field("early_stopping", {"oneOf": [_BOOL, {"enum": ["never"]}]},
          "beam search: true, false (default) or \"never\", as transformers defines them", extension=True),
    Field("stop_token_ids", {**_IDS, "maxItems": 64}, "token ids that end the choice", extension=True),
    Field("include_stop_str_in_output", _BOOL, "keep the matched stop string in the text", extension=True),
    Field("skip_special_tokens", _BOOL, "leave special tokens out of the text (default true)", extension=True),
    Field("bad_words", {**_STRS, "maxItems": 64}, "words (as token sequences) never generated", extension=True),
    Field("allowed_token_ids", {**_IDS, "minItems": 1}, "sample only among these", extension=True),
    Field("prompt_logprobs", {**_INT, "minimum": 0, "maximum": 20},
          "log-probs of the prompt's tokens (non-streamed answers; completions with echo: in `logprobs`)",
          extension=True),
    Field("guided_json", {"oneOf": [{"type": "object"}, _STR]}, "output follows this JSON schema", extension=True),
    Field("guided_regex", _STR, "output matches this regular expression", extension=True),
    Field("guided_grammar", _STR, "output follows this EBNF grammar (GBNF dialect, root rule `root`)",
          extension=True),
    Field("guided_choice", {**_STRS, "minItems": 1}, "output is exactly one of these strings", extension=True),
    Field("timeout", {**_NUM, "exclusiveMinimum": 0}, "seconds; capped by the tenant's / server's maximum",
          extension=True),
    Field("priority", {**_INT, "minimum": 0, "maximum": MAX_PRIORITY},
          "scheduling class, lower is more urgent; never more urgent than the API key's (the larger one counts)",
          extension=True),
    Field("allow_degrade", _BOOL, "admission may lower n instead of refusing (default true)", extension=True),
    Field("return_token_ids", _BOOL, "each non-streamed choice's token ids", extension=True),
    Field("return_stage_times", _BOOL, "usage.stage_times, for a tenant allowed to see it", extension=True),
]

# OpenAI fields pdserve does not implement -> (why, the values that change nothing and are let through)
UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "suffix": ("insertion (a suffix after the completion) is not supported", ()),
    "functions": ("the deprecated functions API is not supported; use tools", ()),
    "function_call": ("the deprecated functions API is not supported; use tool_choice", ()),
    "audio": ("audio output is not supported", ()),
    "modalities": ("only text output is supported", (["text"],)),
    "prediction": ("predicted outputs are not supported", ()),
    "store": ("stored completions are not supported", (False,)),
    "metadata": ("stored completions (metadata) are not supported", ()),
    "service_tier": ("service tiers are not supported", ("auto", "default")),
    "reasoning_effort": ("this model has no reasoning effort setting", ()),
    "web_search_options": ("web search is not supported", ()),
    "verbosity": ("this model has no verbosity setting", ("medium",)),
    "prompt_cache_retention": ("prompt caches live in the workers' memory only", ("in_memory",)),
    "prompt_cache_options": ("prompt caching is implicit (the prefix cache); it has no options", ()),
    "moderation": ("moderation is not supported", ()),
}

_BY_ENDPOINT = {ep: {f.name: f for f in FIELDS if ep in f.endpoints} for ep in BOTH}
_ALL = {f.name for f in FIELDS}


def fields_for(chat: bool) -> dict[str, Field]:
    return _BY_ENDPOINT[CHAT if chat else COMPLETIONS]


def check_known(body: dict, chat: bool) -> None:
    """400 for a field this endpoint does not take: unknown, the other endpoint's, or not implemented."""
    other = "/v1/completions" if chat else "/v1/chat/completions"
    check_fields(body, fields_for(chat), UNSUPPORTED, (_ALL, other))


def check_fields(body: dict, known, unsupported: dict, elsewhere: tuple[set, str] | None = None) -> None:
    """An endpoint's field check: each key of `body` is `known`, or refused with its reason unless it carries a
    value that changes nothing (`unsupported`: name -> (reason, no-op values)), or another endpoint's
    (`elsewhere`: its names and path), or unknown."""
    for name, v in body.items():
        if name in known:
            continue
        if name in unsupported:
            why, noop = unsupported[name]
            if v is None or any(type(v) is type(x) and v == x for x in noop):
                continue
            raise bad(name, why)
        if elsewhere is not None and name in elsewhere[0]:
            raise bad(name, f"is a {elsewhere[1]} parameter")
        raise bad(name[:100] or '""', "unknown parameter")
