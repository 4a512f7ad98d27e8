"""OpenAI request bodies -> SamplingParams, with errors that name the offending field (HTTP 400)."""
from __future__ import annotations

import json
import math

from pdserve.engine.grammar_limits import GrammarLimits, LimitExceeded
from pdserve.engine.grammar_limits import check as check_limits
from pdserve.engine.sampling_params import GuidedSpec, InvalidParameter, SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, why: str) -> APIError:
    return APIError(400, f"invalid parameter '{param}': {why}", param=param, code="invalid_parameter")


# The proto's integer fields are int32 (common.proto SamplingParams): a larger value passed every check here and
# then failed to serialize after admission, a 500. Each integer gets its own range up front.
INT32_MAX = 2**31 - 1
MAX_N = 128  # OpenAI's cap on `n`: n (x prompts) requests fan out from one body


def _num(body: dict, name: str, kind=float, default=None, lo: int = -INT32_MAX - 1, hi: int = INT32_MAX):
    """A number field, or `default` when absent/null. Integers must lie in [lo, hi]; numbers must be finite
    (a huge JSON integer does not fit a float: OverflowError, not a value)."""
    v = body.get(name, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"must be {'an integer' if kind is int else 'a number'}")
    if kind is int:
        if isinstance(v, float):
            if not (math.isfinite(v) and v.is_integer()):
                raise bad(name, "must be an integer")
            v = int(v)
        if not lo <= v <= hi:
            raise bad(name, f"must be an integer in [{lo}, {hi}]")
        return v
    f = _float(v)
    if not math.isfinite(f):
        raise bad(name, "must be a finite number")
    return f


def _float(v: int | float) -> float:
    try:
        return float(v)
    except OverflowError:  # an integer beyond the float range
        return math.inf


def flag(body: dict, name: str, default: bool = False) -> bool:
    """A boolean field: JSON true/false (or null for the default), nothing truthy."""
    v = body.get(name, None)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, "must be true or false")
    return v


def _schema_text(v, param: str) -> str:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except (ValueError, RecursionError):
            raise bad(param, "must be a JSON schema (an object, or its JSON text)") from None
    if not isinstance(v, dict):
        raise bad(param, "must be a JSON schema (an object, or its JSON text)")
    try:  # strict JSON for the worker's grammar compiler: no NaN / Infinity
        return json.dumps(v, allow_nan=False)
    except (ValueError, RecursionError):
        raise bad(param, "must be a JSON schema object") from None


def _str(body: dict, name: str, max_len: int = 1 << 16) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise bad(name, "must be a non-empty string")
    if len(v) > max_len:
        raise bad(name, f"must be at most {max_len} characters")
    return v


def _list(body: dict, name: str, item, what: str, max_items: int, min_items: int = 0) -> list | None:
    """A list whose items pass `item` (no bools for integers), of [min_items, max_items] entries."""
    v = body.get(name)
    if v is None:
        return None
    if item is _is_id:
        v = integrals(v)
    if not isinstance(v, list) or not min_items <= len(v) <= max_items or not all(item(x) for x in v):
        raise bad(name, f"must be a list of {min_items}..{max_items} {what}")
    return list(v)


def integral(x):
    """A JSON number with no fraction as the integer it is (`5.0` is the integer 5 in JSON Schema, and an
    integer field takes it); anything else unchanged. Never a bool."""
    if isinstance(x, float) and math.isfinite(x) and x.is_integer():
        return int(x)
    return x


def integrals(v):
    """`integral` of a list's items (and of its lists' items): token ids as a JSON Schema validator reads them."""
    if not isinstance(v, list):
        return v
    return [integrals(x) if isinstance(x, list) else integral(x) for x in v]


def _is_id(x) -> bool:
    return type(x) is int and 0 <= x <= INT32_MAX  # noqa: E721 - a bool is not a token id


def _is_text(x) -> bool:
    return isinstance(x, str) and 0 < len(x) <= 1024


def choice_grammar(choices: list[str]) -> str:
    """`guided_choice`: an EBNF whose language is exactly the given strings (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _extension_guided(body: dict) -> tuple[str, GuidedSpec] | None:
    """The one guided_* extension given, if any."""
    found = []
    if body.get("guided_json") is not None:
        found.append(("guided_json", GuidedSpec(json_schema=_schema_text(body["guided_json"], "guided_json"))))
    rx = _str(body, "guided_regex")
    if rx is not None:
        found.append(("guided_regex", GuidedSpec(regex=rx)))
    gr = _str(body, "guided_grammar")
    if gr is not None:
        found.append(("guided_grammar", GuidedSpec(grammar=gr)))
    ch = _list(body, "guided_choice", _is_text, "non-empty strings (up to 1024 characters)", 256, 1)
    if ch is not None:
        found.append(("guided_choice", GuidedSpec(grammar=choice_grammar(ch))))
    if len(found) > 1:
        raise bad(found[1][0], f"only one constraint per request (also given: {found[0][0]})")
    return found[0] if found else None


def _guided(rf) -> GuidedSpec | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or "type" not in rf:
        raise bad("response_format", "must be an object with a 'type'")
    t = rf["type"]
    if t == "text":
        return None
    if t == "json_object":
        return GuidedSpec(json_object=True)
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise bad("response_format.json_schema.schema", "must be a JSON schema object")
        return GuidedSpec(json_schema=_schema_text(js["schema"], "response_format.json_schema.schema"))
    raise bad("response_format.type", f"unsupported type {t!r} (text, json_object, json_schema)")


def to_sampling_params(body: dict, *, chat: bool, vocab_size: int) -> SamplingParams:
    """The body's sampling fields, each checked (a 400 naming it), then the whole (`validate`)."""
    p = SamplingParams()
    _copies(body, chat, p)
    p.temperature = _num(body, "temperature", float, 1.0)
    p.top_p = _num(body, "top_p", float, 1.0)
    p.top_k = _num(body, "top_k", int, 0, -1)
    p.min_p = _num(body, "min_p", float, 0.0)
    p.seed = _num(body, "seed", int, None, 0, 2**63 - 1)  # int64 in the proto
    echo = flag(body, "echo")
    if echo and chat:
        raise bad("echo", "is a /v1/completions parameter")
    if echo and flag(body, "stream"):
        raise bad("echo", "is not supported with stream")
    _length(body, chat, echo, p)
    p.presence_penalty = _num(body, "presence_penalty", float, 0.0)
    p.frequency_penalty = _num(body, "frequency_penalty", float, 0.0)
    p.repetition_penalty = _num(body, "repetition_penalty", float, 1.0)
    p.logit_bias = _logit_bias(body)
    _logprobs(body, chat, echo, p)
    p.typical_p = _num(body, "typical_p", float, 1.0)
    p.beam_width = _num(body, "beam_width", int, None, 1, MAX_N)
    p.length_penalty = _num(body, "length_penalty", float, 1.0)
    es = body.get("early_stopping")
    if es is not None:
        if es not in (True, False, "never") or isinstance(es, (int, float)) and not isinstance(es, bool):
            raise bad("early_stopping", 'must be true, false or "never"')
        p.early_stopping = es
    p.no_repeat_ngram_size = _num(body, "no_repeat_ngram_size", int, 0, 0)
    p.stop_token_ids = _list(body, "stop_token_ids", _is_id, "token ids", 64) or []
    p.include_stop_str_in_output = flag(body, "include_stop_str_in_output")
    p.skip_special_tokens = flag(body, "skip_special_tokens", True)
    p.bad_words = _list(body, "bad_words", _is_text, "non-empty strings (up to 1024 characters)", 64) or []
    p.allowed_token_ids = _list(body, "allowed_token_ids", _is_id, "token ids", 1 << 20, 1)
    p.guided = _guided(body.get("response_format"))
    ext = _extension_guided(body)
    if ext is not None:
        if p.guided is not None:
            raise bad(ext[0], "only one constraint per request (also given: response_format)")
        p.guided = ext[1]
    validate(p, vocab_size)
    return p


def _copies(body: dict, chat: bool, p: SamplingParams) -> None:
    """`n`, and `best_of` (completions): the n best of best_of are known only at the end (OpenAI: not streamed)."""
    p.n = _num(body, "n", int, 1, 1, MAX_N)
    best_of = None if chat else _num(body, "best_of", int, None, 1, MAX_N)
    if best_of is not None and best_of < p.n:
        raise bad("best_of", f"must be >= n ({p.n})")
    if best_of is not None and best_of > p.n:
        if flag(body, "stream"):
            raise bad("best_of", "best_of > n cannot be streamed")
        p.best_of = best_of


def _length(body: dict, chat: bool, echo: bool, p: SamplingParams) -> None:
    """max_completion_tokens / max_tokens, min_tokens, stop strings, ignore_eos."""
    mt = _num(body, "max_completion_tokens", int, None, 1) if chat else None
    if mt is None:
        # with echo, max_tokens 0 asks for the prompt's log-probs only (lm-eval's loglikelihood): the engine
        # samples one token, which the answer leaves out (prompt_only)
        mt = _num(body, "max_tokens", int, None if chat else 16, 0 if echo else 1)
    p.max_tokens = max(mt, 1) if mt is not None else None
    p.min_tokens = _num(body, "min_tokens", int, 0, 0)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 16:
            raise bad("stop", "must be a string or a list of up to 16 strings")
        p.stop = stop
    p.ignore_eos = flag(body, "ignore_eos", p.ignore_eos)


def _logit_bias(body: dict) -> dict[int, float]:
    lb = body.get("logit_bias")
    if lb is None:
        return {}
    if not isinstance(lb, dict):
        raise bad("logit_bias", "must map token ids to biases")
    bias = {}
    for k, v in lb.items():
        # a token id is a short decimal (int() of a 5,000-digit string raises, it does not return)
        if not (k.isascii() and 0 < len(k) <= 12 and k.strip().lstrip("+-").isdigit()) or isinstance(v, bool) \
                or not isinstance(v, (int, float)):
            raise bad("logit_bias", "keys must be token ids and values numbers")
        if not math.isfinite(_float(v)):
            raise bad("logit_bias", "values must be finite numbers")
        bias[int(k)] = float(v)
    return bias


def _logprobs(body: dict, chat: bool, echo: bool, p: SamplingParams) -> None:
    """Chat: logprobs (a flag) + top_logprobs; completions: logprobs (a count), which with echo covers the prompt
    too; the prompt_logprobs extension (not with stream or echo)."""
    if chat:
        if flag(body, "logprobs"):
            p.logprobs = _num(body, "top_logprobs", int, 0, 0, 20)
        elif body.get("top_logprobs") is not None:
            raise bad("top_logprobs", "requires logprobs=true")
    else:
        p.logprobs = _num(body, "logprobs", int, None, 0, 20)
        if echo and p.logprobs is not None:  # the echoed prompt's tokens get log-probs too
            p.prompt_logprobs = p.logprobs
    plp = _num(body, "prompt_logprobs", int, None, 0, 20)
    if plp is not None:
        if flag(body, "stream"):
            raise bad("prompt_logprobs", "is not supported with stream")
        if echo:
            raise bad("prompt_logprobs", "with echo, the prompt's log-probs come with `logprobs`")
        p.prompt_logprobs = plp


# The log-prob values one answer may carry (each returned token's own and its top alternatives, over the output and
# over the prompt for `echo` / `prompt_logprobs`). The gateway builds that answer, and a client controls its size:
# 300 prompts x 300 tokens x 21 values took over a minute to answer and stalled every other request (docs/reliability.md,
# Hostile neighbours). lm-eval's log-likelihood batches (echo, logprobs 1, 2k-token prompts) use ~4k a prompt.
DEFAULT_MAX_LOGPROB_ENTRIES = 500_000


def logprob_entries(prompts: list[list[int]], p: SamplingParams, prompt_only: bool, max_len: int) -> int:
    """The log-prob values the answer to `prompts` carries at most: per returned choice (n per prompt), its output
    tokens (up to max_tokens, none for a prompt-only echo) x (1 + logprobs), and its prompt's tokens after the
    first x (1 + prompt_logprobs)."""
    total = 0
    for ids in prompts:
        per = 0
        if p.logprobs is not None and not prompt_only:
            out = p.max_tokens if p.max_tokens is not None else max_len - len(ids)
            per += out * (1 + p.logprobs)
        if p.prompt_logprobs is not None:
            per += (len(ids) - 1) * (1 + p.prompt_logprobs)
        total += per * p.n
    return total


def check_logprob_volume(body: dict, chat: bool, prompts: list[list[int]], p: SamplingParams, prompt_only: bool,
                         max_len: int, limit: int) -> None:
    """A 400 naming the field when the answer's log-prob values would exceed `limit` (--max-logprob-entries)."""
    entries = logprob_entries(prompts, p, prompt_only, max_len)
    if entries <= limit:
        return
    if body.get("prompt_logprobs") is not None:
        param = "prompt_logprobs"
    else:
        param = ("top_logprobs" if body.get("top_logprobs") else "logprobs") if chat else "logprobs"
    raise APIError(400, f"'{param}': the answer would carry {entries:,} log-prob values ({len(prompts)} prompt(s) x "
                        f"tokens x n={p.n} x (1 + top alternatives)), over the server's limit of {limit:,} "
                        "(--max-logprob-entries): send fewer prompts per request, fewer tokens or fewer top "
                        "log-probs", param=param, code="logprobs_too_large")


def prompt_only(body: dict) -> bool:
    """`echo` with `max_tokens: 0`: the prompt (and its log-probs) without a completion. After
    to_sampling_params has checked both fields."""
    return body.get("echo") is True and body.get("max_tokens") == 0


GUIDED_EXTENSIONS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")


def check_guided(p: SamplingParams, limits: GrammarLimits, field: str) -> None:
    """The constraint within this server's bounds (engine/grammar_limits.py): a 400 naming `field` (what the
    client wrote: response_format, guided_*, tools) and the limit, before anything is admitted or compiled."""
    try:
        check_limits(p.guided, limits)
    except LimitExceeded as e:
        raise bad(field, e.why) from None


def guided_field(body: dict, tools_constrained: bool) -> str:
    """Where a request's constraint came from, as the client wrote it."""
    if tools_constrained:
        return "tools"
    return next((n for n in GUIDED_EXTENSIONS if body.get(n) is not None), "response_format")


def validate(p: SamplingParams, vocab_size: int) -> None:
    """The engine's own checks, as a 400 naming the parameter."""
    try:
        p.validate(vocab_size)
    except InvalidParameter as e:
        raise APIError(400, str(e), param=e.param, code="invalid_parameter") from None
