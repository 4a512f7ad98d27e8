"""`/tokenize`, `/detokenize` and `/tokenizer_info`, in vLLM's request and response shapes (docs/api.md,
"Tokenizer endpoints").

`/tokenize` takes a completion form (`prompt`, `add_special_tokens`) or a chat form (`messages`,
`add_generation_prompt`, `continue_final_message`, `tools`, `add_special_tokens`) and answers `{count,
max_model_len, tokens, token_strs}`; `/detokenize` takes `{tokens}` and answers `{prompt}`. The chat form's
tokens are the ones /v1/chat/completions would feed the model for the same messages (unless
`add_special_tokens` says otherwise). `/tokenizer_info` is what lm-eval's `local-completions` probes for (with
`/tokenize`) to use the server's tokenizer instead of loading one from the Hugging Face hub.

Each is authenticated and rate-limited as the generation endpoints are (ingress.admit), and bounded by the body
limit (`--max-body-bytes`); rendering and tokenizing a large input run on the parser's thread pool, not on the
event loop.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pdserve.services.gateway.ingress import IngressGate
from pdserve.services.gateway.params import bad, flag, integrals
from pdserve.services.gateway.parse import RequestParser
from pdserve.services.gateway.tools.request import tool_request

_COMPLETION = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT = {"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens", "tools",
         "return_token_strs"}
_REFUSED = {"chat_template": "a client's chat template is not run: the checkpoint's is",
            "chat_template_kwargs": "template arguments are not supported",
            "mm_processor_kwargs": "only text models are served"}
_INFO_KEYS = ("tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token",
              "add_eos_token", "clean_up_tokenization_spaces")


def _check_names(body: dict, known: set[str]) -> None:
    for name in body:
        if name in _REFUSED:
            if body[name] is not None:
                raise bad(name, _REFUSED[name])
        elif name not in known:
            raise bad(name[:100] or '""', "unknown parameter")


def _continued(text: str, msgs: list[dict]) -> str:
    """`continue_final_message`: the rendering cut right after the last message's content, so the model goes on
    writing it (transformers' rule)."""
    last = msgs[-1].get("content")
    if not isinstance(last, str) or not last.strip() or last.strip() not in text:
        raise bad("continue_final_message", "the final message must have text content to continue")
    return text[:text.rindex(last.strip()) + len(last.strip())]


class TokenizeService:
    def __init__(self, parser: RequestParser, max_len: int):
        self.parser, self.tok, self.max_len = parser, parser.tok, max_len

    async def tokenize(self, body: dict) -> dict:
        special = body.get("add_special_tokens")
        if special is not None:
            special = flag(body, "add_special_tokens")
        if "messages" in body:
            _check_names(body, _CHAT)
            ids = await self._chat(body, special)
        else:
            _check_names(body, _COMPLETION)
            if not isinstance(body.get("prompt"), str):
                raise bad("prompt", "must be a string (or send `messages`, the chat form)")
            ids = await self.parser.run_off_loop(self.tok.encode_many, [body["prompt"]], special is not False)
            ids = ids[0]
        strs = [self.tok.id_to_token(t) for t in ids] if flag(body, "return_token_strs") else None
        return {"count": len(ids), "max_model_len": self.max_len, "tokens": ids, "token_strs": strs}

    async def _chat(self, body: dict, special: bool | None) -> list[int]:
        msgs = self.parser.messages(body)
        gen, cont = flag(body, "add_generation_prompt", True), flag(body, "continue_final_message")
        if gen and cont:
            raise bad("continue_final_message", "cannot be combined with add_generation_prompt: true")
        treq = tool_request({"tools": body["tools"]}) if body.get("tools") is not None else None
        tools = treq.tools if treq is not None else None

        def render() -> list[int]:
            text = self.parser.render(msgs, tools, add_generation_prompt=gen and not cont)
            if cont:
                text = _continued(text, msgs)
            # the chat endpoint's rule: BOS from the tokenizer only when the template did not write it
            add = special if special is not None else not (self.tok.bos_token and text.startswith(self.tok.bos_token))
            return self.tok.encode_many([text], add_special_tokens=add)[0]

        return await self.parser.run_off_loop(render)

    async def detokenize(self, body: dict) -> dict:
        _check_names(body, {"model", "tokens"})
        ids = integrals(body.get("tokens"))
        vocab = self.parser.vocab
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < vocab for t in ids):  # noqa: E721
            raise bad("tokens", f"must be a list of token ids (integers in [0, {vocab}))")
        text = await self.parser.run_off_loop(self.tok.decode, ids, False)
        return {"prompt": text}

    def info(self) -> dict:
        cfg = self.tok.config
        out = {k: cfg[k] for k in _INFO_KEYS if k in cfg and isinstance(cfg[k], (str, bool, int, type(None)))}
        out.update({"bos_token": self.tok.bos_token, "eos_token": self.tok.eos_token,
                    "model_max_length": self.max_len, "chat_template": self.tok.chat_template})
        for name in ("pad_token", "unk_token"):
            if name in self.tok.special_tokens_map:
                out[name] = self.tok.special_tokens_map[name]
        return out


def install(app: FastAPI, gate: IngressGate, parser: RequestParser, max_len: int) -> None:
    svc = TokenizeService(parser, max_len)

    async def admitted(request: Request) -> dict:
        a = await gate.admit(request)  # the body within its limits, then the API key and its rate
        return parser.body(a.body)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return JSONResponse(await svc.tokenize(await admitted(request)))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return JSONResponse(await svc.detokenize(await admitted(request)))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        gate.authenticate(request.headers)
        return JSONResponse(svc.info())
