"""Chat templates rendered the way `transformers` renders them, in a sandbox.

A checkpoint's chat template is code from whoever published the checkpoint, so it runs in Jinja's
`ImmutableSandboxedEnvironment` (no attribute starting with `_`, no mutation of the messages), as
`transformers.PreTrainedTokenizerBase.apply_chat_template` does. Everything a template can call is what
transformers provides, so a template renders byte-for-byte as it does there (tests/engine/test_chat_template.py
compares the two on real Llama-3, Qwen2.5, Mistral and SmolLM2 templates):

- `trim_blocks` / `lstrip_blocks`, the `loopcontrols` extension (`{% break %}`, `{% continue %}`) and a
  pass-through `{% generation %}` block (transformers uses it to mark assistant tokens for training);
- `tojson` with `ensure_ascii=False` and the `indent` / `separators` / `sort_keys` arguments (Jinja's own filter
  HTML-escapes and would turn "é" into "\\u00e9"), `raise_exception`, `strftime_now`, a `dict` and a `namespace`
  that refuse underscore names;
- the variables: `messages`, `tools`, `documents`, `add_generation_prompt`, the named special tokens
  (`bos_token`, `eos_token`, ...; absent ones stay undefined, not ""), and any extra keyword.

Every failure of a template (a `raise_exception`, a sandbox refusal, a template that does not fit the messages) is
a `ChatTemplateError`, a `ValueError`, which the gateway answers with a 400 naming `messages`.

A template is also bounded in what it costs: the sandbox keeps it from escaping, not from
looping 10^8 times (4.5 s) or writing `'a' * 10**8`. `render` streams the output and stops past `max_chars`; a
trace function on the rendering thread's template frames stops it past `budget_s` (a loop with an empty body
writes nothing, so counting output alone would not); `*` and `**` are checked before they build a huge string,
list or integer in one C call that no trace could interrupt.
"""
from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The named special tokens transformers passes to every template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Older names for a message's reasoning; transformers fills `reasoning_content` (and `thinking`) from them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# What one render may cost. Real templates write a few dozen characters per message and render a 2,048-message
# conversation in well under 0.1 s; the bounds stop a template written to stall whoever renders it.
MAX_RENDER_CHARS = 4 << 20
RENDER_BUDGET_S = 2.0
_MAX_POW_BITS = 1 << 16  # `**` of integers: a result up to 64 Ki bits (computing 10**10**9 would run for minutes)
_CHECK_EVERY = 256  # template lines between two clock reads in the trace function


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (or may not run at all)."""


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without exposing the `dict` type itself (its class attributes)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace` that refuses underscore attribute names (`ns.__class__ = ...` style escapes)."""

    def __init__(*args, **kwargs):  # same signature trick as Jinja's Namespace: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template may not set the underscore attribute {name!r} on a namespace")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged (transformers uses the block only to
    find assistant tokens for training masks); without it such templates would not even compile."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with `*` and `**` refused where their result would be too big to build (intercepting them
    also keeps Jinja from folding `'a' * 10**8` into a constant at compile time)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            seq, k = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(k, int) and len(seq) * k > MAX_RENDER_CHARS:
                raise SecurityError(f"a repetition of {len(seq)} x {k} exceeds {MAX_RENDER_CHARS} items")
        elif isinstance(left, int) and isinstance(right, int) and right > 0 \
                and max(left.bit_length(), 1) * right > _MAX_POW_BITS:
            raise SecurityError(f"a power of over {_MAX_POW_BITS} bits")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except TemplateSyntaxError as e:
        raise ChatTemplateError(f"the model's chat template does not parse (line {e.lineno}: {e.message})") from e


def _plain(value: Any) -> Any:
    """A deep copy made of JSON types only: a template sees no object with methods the sandbox does not know."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def _normalize(messages: list[dict]) -> list[dict]:
    """As transformers does: keys whose value is None are dropped (templates test `is defined`, and would print
    "None"), and reasoning given under an older name is also passed as `reasoning_content` / `thinking`."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise ChatTemplateError(f"each message must be an object, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(_plain(m))
    return out


class _Budget:
    """A trace function for the rendering thread: in the template's own frames (compiled Jinja code, file
    `<template>`), every `_CHECK_EVERY` lines, the clock against the deadline. Other frames are not traced."""

    def __init__(self, budget_s: float):
        self.budget_s = budget_s
        self.deadline = time.monotonic() + budget_s
        self.lines = 0

    def __call__(self, frame, event, arg):
        return self._line if frame.f_code.co_filename == "<template>" else None

    def _line(self, frame, event, arg):
        self.lines += 1
        if self.lines % _CHECK_EVERY == 0 and time.monotonic() > self.deadline:
            raise ChatTemplateError(f"the chat template ran for over {self.budget_s:g} s")
        return self._line


def _bounded(template: jinja2.Template, max_chars: int, budget_s: float, variables: dict) -> str:
    """`template.render(**variables)`, stopped past `max_chars` of output or `budget_s` of time."""
    out, size = [], 0
    previous = sys.gettrace()  # a debugger's or coverage's: put back after
    sys.settrace(_Budget(budget_s))
    try:
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > max_chars:
                raise ChatTemplateError(f"the chat template's output exceeds {max_chars} characters")
            out.append(chunk)
    finally:
        sys.settrace(previous)
    return "".join(out)


def render(source: str, messages: list[dict], *, add_generation_prompt: bool = False,
           tools: list[dict] | None = None, documents: list[dict] | None = None,
           special_tokens: dict[str, str] | None = None, max_chars: int = MAX_RENDER_CHARS,
           budget_s: float = RENDER_BUDGET_S, **kwargs) -> str:
    """Render `source` over `messages` exactly as `tokenizer.apply_chat_template(..., tokenize=False)` does, within
    `max_chars` of output and `budget_s` seconds."""
    template = compile_template(source)
    if not messages:
        raise ChatTemplateError("cannot apply the chat template to an empty conversation")
    variables = _plain({**(special_tokens or {}), **kwargs})
    try:
        return _bounded(template, max_chars, budget_s, dict(
            messages=_normalize(messages), tools=_plain(tools), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt, **variables))
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"the chat template was stopped by the sandbox: {e}") from None
    except TemplateError as e:  # raise_exception(...) and undefined-variable errors: the template's own words
        raise ChatTemplateError(f"chat template: {e.message or e}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as e:
        # a template that does not fit these messages (e.g. content given as a list where it adds strings)
        raise ChatTemplateError(f"the chat template failed on these messages ({type(e).__name__}: {e})") from None
