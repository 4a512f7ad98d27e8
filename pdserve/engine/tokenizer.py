"""Tokenizer of a checkpoint: tokenizer.json + tokenizer_config.json (chat template, special tokens)."""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as HFTokenizer

from pdserve.engine.errors import CheckpointError


def _token_text(tok) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, dict):  # AddedToken serialised form
        return tok.get("content")
    return str(tok)


class Tokenizer:
    """Thin wrapper over `tokenizers.Tokenizer` with the checkpoint's chat template and special tokens."""

    def __init__(self, model_dir: str | Path, eos_token_ids: list[int] | None = None):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(f"{model_dir}: missing tokenizer.json")
        try:
            self.hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust error names the parse problem
            raise CheckpointError(f"{path}: malformed tokenizer.json ({e})") from e
        cfg: dict = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{cfg_path}: malformed JSON ({e})") from e
        self.config = cfg
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.bos_token_id = self.hf.token_to_id(self.bos_token) if self.bos_token else None
        ids = list(eos_token_ids or [])
        if self.eos_token and self.hf.token_to_id(self.eos_token) is not None:
            ids.append(self.hf.token_to_id(self.eos_token))
        self.eos_token_ids: list[int] = sorted(set(ids))
        # Special tokens are added tokens flagged special; read the added-token table once (it is small), not
        # once per vocabulary entry.
        added = self.hf.get_added_tokens_decoder() if hasattr(self.hf, "get_added_tokens_decoder") else {}
        self.special_token_ids: set[int] = {tid for tid, at in added.items() if at.special}

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._with_bos(self.hf.encode(text, add_special_tokens=add_special_tokens).ids, add_special_tokens)

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text. The Rust batch call releases the GIL (`encode` holds it), so a caller on a worker
        thread leaves the event loop's thread free while a long prompt is tokenized."""
        return [self._with_bos(e.ids, add_special_tokens)
                for e in self.hf.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def _with_bos(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        # Some tokenizer.json files carry no BOS post-processor; tokenizer_config says whether to add one.
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, tid: int) -> str | None:
        return self.hf.id_to_token(tid)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template; use the completions API")
        env = jinja2.Environment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg: str):
            raise ValueError(f"chat template: {msg}")

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
