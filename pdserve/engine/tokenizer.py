"""Tokenizer of a checkpoint: tokenizer.json + tokenizer_config.json (special tokens) + its chat template(s)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from pdserve.engine import chat_template
from pdserve.engine.errors import CheckpointError

# Where checkpoints keep chat templates, in the order transformers reads them: files written by current
# transformers (`chat_template.jinja`, extra named ones in `additional_chat_templates/`) win over the
# `chat_template` key of tokenizer_config.json; `chat_template.json` (a processor's file) is the last resort.
TEMPLATE_PLACES = "chat_template.jinja, additional_chat_templates/, tokenizer_config.json, chat_template.json"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _named(value, where: Path) -> dict[str, str]:
    """A `chat_template` value (one string, or a list of {name, template}) as templates by name."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise CheckpointError(f"{where}: chat_template must be a string or a list of {{name, template}} objects")


def load_chat_templates(model_dir: Path, tokenizer_config: dict) -> dict[str, str]:
    """The checkpoint's chat templates by name ("default" is the one used unless tools pick "tool_use")."""
    files: dict[str, str] = {}
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        files["default"] = jinja.read_text(encoding="utf-8")
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if files:
        return files
    if "chat_template" in tokenizer_config:
        return _named(tokenizer_config["chat_template"], model_dir / "tokenizer_config.json")
    legacy = model_dir / "chat_template.json"
    if legacy.is_file():
        return _named(_read_json(legacy).get("chat_template"), legacy)
    return {}


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
        self.model_dir = model_dir
        cfg_path = model_dir / "tokenizer_config.json"
        cfg: dict = _read_json(cfg_path) if cfg_path.is_file() else {}
        self.config = cfg
        self.chat_templates: dict[str, str] = load_chat_templates(model_dir, cfg)
        # the template used without tools: "default", or the only one there is
        self.chat_template: str | None = self.chat_templates.get("default") or (
            next(iter(self.chat_templates.values())) if len(self.chat_templates) == 1 else None)
        # what transformers passes every template: the named special tokens this checkpoint defines (an older
        # checkpoint may name some only in special_tokens_map.json)
        smap_path = model_dir / "special_tokens_map.json"
        smap = _read_json(smap_path) if smap_path.is_file() else {}
        self.special_tokens_map: dict[str, str] = {}
        for name in chat_template.SPECIAL_TOKEN_NAMES:
            text = _token_text(cfg.get(name) if cfg.get(name) is not None else smap.get(name))
            if text is not None:
                self.special_tokens_map[name] = text
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

    def template_for(self, tools: list[dict] | None = None) -> str:
        """The template transformers would pick: "tool_use" when tools are given and the checkpoint has one."""
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template:
            return self.chat_template
        if self.chat_templates:
            raise chat_template.ChatTemplateError(
                f"{self.model_dir} has several chat templates and none named 'default': "
                f"{', '.join(sorted(self.chat_templates))}")
        raise chat_template.ChatTemplateError(
            f"{self.model_dir} has no chat template (looked in {TEMPLATE_PLACES}); use the completions API, or "
            "add the model's template as chat_template.jinja")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """The prompt text, as `transformers` renders it with `tokenize=False`; a `ValueError`
        (`ChatTemplateError`) names what went wrong, including a template the sandbox stops."""
        return chat_template.render(self.template_for(tools), messages, add_generation_prompt=add_generation_prompt,
                                    tools=tools, special_tokens=self.special_tokens_map, **kwargs)
