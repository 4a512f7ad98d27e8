"""Request bodies, parsed strictly before anything acts on them.

Every value the gateway reads is checked for its JSON type and range here or in params.py, so bad input is a
400 naming the field, never an exception further in (a 500). Found by a fuzzer: `stream_options` not an object,
lone surrogates (`"ab\\ud800cd"`: valid JSON, not encodable as UTF-8, so the tokenizer and protobuf raise),
booleans as token ids (`True` is an `int` in Python), a content part whose text is not a string.

Tokenization of a large prompt runs on a small thread pool, not on the event loop: a 1 MB prompt takes ~1 s to
tokenize, and on the loop it stalled every other request for that long. The pool's threads call the tokenizer's
batch API, which releases the GIL while it works. Chat-template rendering always runs there:
its cost is the template's, not the content's (61,000 `{"role": "user"}` messages, 976 KB with no content at
all, rendered for ~0.85 s on the loop), and the template's own bounds (chat_template.py) stop it there.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import jinja2

from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.gateway.fields import check_known
from pdserve.services.gateway.params import APIError, _num, bad, flag, integrals
from pdserve.services.gateway.redact import scrub
from pdserve.services.gateway.tools.request import history_message

# Text up to this many characters is tokenized inline: the thread hop (~50-100 us) costs more than the encode.
INLINE_CHARS = 8 << 10
TOKENIZE_THREADS = 2  # bounded: a burst of huge prompts queues here instead of starting a thread each
MAX_PROMPTS = 1024  # prompts in one completions body (each one is an engine request, times n)
MAX_MESSAGES = 2048  # messages in one chat body (OpenAI's limit): checked before any is rendered
ROLES = ("system", "developer", "user", "assistant", "tool")


def _reject_constant(name: str):
    raise ValueError(name)  # NaN, Infinity, -Infinity: Python's json accepts them, JSON does not


def _lone_surrogate(body) -> str | None:
    """Path of the first string (or key) that cannot be encoded as UTF-8, else None. Iterative: the body may be
    nested as deep as the JSON parser allows."""
    stack: list[tuple[str, object]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                p = f"{path}.{k}" if path else k
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
                if isinstance(x, (str, dict, list)):
                    stack.append((p, x))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v) if isinstance(x, (str, dict, list)))
    return None


def _token_ids(x, vocab: int) -> bool:
    return isinstance(x, list) and all(type(t) is int and 0 <= t < vocab for t in x)  # noqa: E721 - no bools


class RequestParser:
    def __init__(self, tok: Tokenizer, vocab: int, max_len: int, served_model_name: str,
                 inline_chars: int = INLINE_CHARS):
        self.tok, self.vocab, self.max_len, self.model = tok, vocab, max_len, served_model_name
        self.inline_chars = inline_chars
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="pdserve-tokenize")

    # ---- the envelope: JSON, strings, the fields the endpoint reads itself ----

    def body(self, raw: bytes, chat: bool | None = None) -> dict:
        """The JSON body, its envelope fields checked; with `chat` given, also every field's name (fields.py)."""
        return self.envelope(self.decode(raw), chat)

    @staticmethod
    def decode(raw: bytes) -> dict:
        """Strict JSON (UTF-8, no NaN, no lone surrogates) that is an object; nothing about its fields."""
        try:
            text = raw.decode("utf-8")  # strict: bytes of a surrogate are refused too
        except UnicodeDecodeError:
            raise APIError(400, "request body is not UTF-8", code="invalid_json") from None
        try:
            body = json.loads(text, parse_constant=_reject_constant)
        except json.JSONDecodeError as e:
            raise APIError(400, f"request body is not valid JSON ({e})", code="invalid_json") from None
        except (ValueError, RecursionError):  # NaN / Infinity; a number too long to convert; nesting too deep
            raise APIError(400, "request body is not valid JSON (NaN, Infinity, an integer of over 4,300 digits "
                                "or nesting too deep)", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        if "\\u" in text:  # only an escape can make a lone surrogate out of strict UTF-8
            where = _lone_surrogate(body)
            if where is not None:  # the path is made of the client's keys: bounded in the answer
                raise bad(where if len(where) <= 200 else where[:199] + "…",
                          "contains a lone UTF-16 surrogate (not encodable as UTF-8)")
        return body

    def envelope(self, body: dict, chat: bool | None = None) -> dict:
        """A decoded body's envelope fields checked (model, flags, stream_options, timeout, user); with `chat`
        given, also every field's name (fields.py)."""
        if chat is not None:
            check_known(body, chat)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad("model", "must be a string")
        if model is not None and model != self.model:
            raise APIError(404, f"The model '{model}' does not exist", "invalid_request_error", "model",
                           "model_not_found")
        for name in ("stream", "return_token_ids", "return_stage_times", "allow_degrade", "echo", "ignore_eos",
                     "include_stop_str_in_output", "skip_special_tokens"):
            flag(body, name)
        so = body.get("stream_options")
        if so is not None:
            if not isinstance(so, dict):
                raise bad("stream_options", "must be an object")
            for k in so:
                if k not in ("include_usage", "include_obfuscation"):  # obfuscation: nothing is padded, a no-op
                    raise bad(f"stream_options.{k[:100]}", "unknown parameter")
                if so[k] is not None and not isinstance(so[k], bool):
                    raise bad(f"stream_options.{k}", "must be true or false")
        if body.get("timeout") is not None and _num(body, "timeout", float) <= 0:
            raise bad("timeout", "must be a positive number of seconds")
        for name in ("user", "safety_identifier", "prompt_cache_key"):
            if body.get(name) is not None and not isinstance(body[name], str):
                raise bad(name, "must be a string")
        return body

    # ---- prompts ----

    def check_room(self, prompts: list[list[int]], max_tokens: int | None, body: dict) -> None:
        """A max_tokens that cannot fit the context after the longest prompt is a 400, not silently cut."""
        if max_tokens is None or not prompts:
            return
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > self.max_len:
            param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            raise APIError(400, f"'{param}' is {max_tokens} but the prompt has {longest} tokens and the context is "
                                f"{self.max_len} tokens: at most {self.max_len - longest} can be generated",
                           param=param, code="context_length_exceeded")

    def check(self, ids: list[int], param: str = "prompt") -> list[int]:
        if not ids:
            raise bad(param, "is empty")
        if len(ids) >= self.max_len:
            raise APIError(400, f"prompt has {len(ids)} tokens; the context is {self.max_len} tokens including "
                                f"output", param=param, code="context_length_exceeded")
        return ids

    def _ids(self, x: list, param: str) -> list[int]:
        """Token ids given as such: integers (not booleans), then the context length, then the vocabulary."""
        if not all(type(t) is int for t in x):  # noqa: E721
            raise bad(param, f"token ids must be integers in [0, {self.vocab})")
        ids = self.check(list(x), param)
        if not _token_ids(ids, self.vocab):
            raise bad(param, f"token ids must be integers in [0, {self.vocab})")
        return ids

    async def _encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        if sum(len(t) for t in texts) <= self.inline_chars:
            return [self.tok.encode(t, add_special_tokens) for t in texts]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.tok.encode_many, texts, add_special_tokens)

    async def run_off_loop(self, fn, *args):
        """`fn(*args)` on the tokenizing pool: for work sized by the client (rendering, encoding, decoding)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def completion_prompts(self, body: dict) -> list[list[int]]:
        p = integrals(body.get("prompt"))
        if isinstance(p, str):
            return [self.check(x) for x in await self._encode([p])]
        if isinstance(p, list) and p:
            if len(p) > MAX_PROMPTS and not all(type(x) is int for x in p):  # noqa: E721
                raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request")
            if all(isinstance(x, str) for x in p):
                return [self.check(x) for x in await self._encode(p)]
            if all(type(x) is int for x in p):  # noqa: E721 - a bool is not a token id
                return [self._ids(p, "prompt")]
            if all(isinstance(x, list) for x in p):
                return [self._ids(x, f"prompt[{i}]") for i, x in enumerate(p)]
        raise bad("prompt", "must be a string, a list of strings, or token ids")

    @staticmethod
    def messages(body: dict) -> list[dict]:
        """The messages as the chat template sees them: content parts joined into one string."""
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad("messages", "must be a non-empty list")
        if len(msgs) > MAX_MESSAGES:
            raise bad("messages", f"at most {MAX_MESSAGES} messages per request (got {len(msgs)})")
        norm = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise bad(f"messages[{i}]", "must be an object")
            if not isinstance(m.get("role"), str):
                raise bad(f"messages[{i}].role", "must be a string")
            if m["role"] not in ROLES:
                raise bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
            if m.get("name") is not None and not isinstance(m["name"], str):
                raise bad(f"messages[{i}].name", "must be a string")
            c = m.get("content")
            if isinstance(c, list):
                texts = []
                for j, part in enumerate(c):
                    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                        raise bad(f"messages[{i}].content[{j}]", "must be a content part object with a type")
                    if part["type"] != "text":
                        raise bad(f"messages[{i}].content[{j}].type", f"{part['type'][:40]!r} content parts are "
                                                                        "not supported (text only)")
                    if not isinstance(part.get("text"), str):
                        raise bad(f"messages[{i}].content[{j}].text", "must be a string")
                    texts.append(part["text"])
                c = "".join(texts)
            elif c is not None and not isinstance(c, str):
                raise bad(f"messages[{i}].content", "must be a string, a list of text parts, or null")
            m = history_message(m, i)
            if c is None and m.get("tool_calls"):  # a call without text: None, which the template leaves out
                norm.append({**m, "role": "assistant", "content": None})
                continue
            if c is None:  # as OpenAI answers: only an assistant's tool calls stand in for content
                raise bad(f"messages[{i}].content", f"is required for a {m['role']} message"
                          + (" without tool_calls" if m["role"] == "assistant" else ""))
            role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name; templates know "system"
            norm.append({**m, "role": role, "content": c})
        return norm

    def render(self, msgs: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
        """The prompt text of checked messages (`_messages`). Template errors are the messages' fault."""
        try:
            return self.tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tools=tools)
        except (ValueError, TypeError, LookupError, jinja2.TemplateError, RecursionError) as e:
            raise bad("messages", scrub(str(e))) from None

    def _render_and_encode(self, msgs: list[dict], tools: list[dict] | None = None, answer_head: str = "") -> list[int]:
        """Chat template -> token ids; called inline or on the pool. `answer_head`: the start of the assistant's
        answer, already written (a named tool call's head)."""
        text = self.render(msgs, tools) + answer_head
        # a template that writes BOS itself must not get a second one from the tokenizer
        special = not (self.tok.bos_token and text.startswith(self.tok.bos_token))
        return self.tok.encode_many([text], add_special_tokens=special)[0]

    async def chat_prompt(self, body: dict, tools: list[dict] | None = None, answer_head: str = "") -> list[int]:
        """`tools`: the tool definitions the template renders (transformers' `tools` argument)."""
        msgs = self.messages(body)
        ids = await asyncio.get_running_loop().run_in_executor(self._pool, self._render_and_encode, msgs, tools,
                                                               answer_head)
        return self.check(ids, "messages")
