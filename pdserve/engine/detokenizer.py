"""Incremental detokenizer (the prefix-offset / read-offset scheme used by HF TGI and vLLM).

Byte-level BPE splits a multi-byte UTF-8 character (CJK, emoji) across tokens; decoding such a
prefix yields U+FFFD. We decode a small window of tokens twice — [prefix, read) and [prefix, end) —
and emit only the new suffix, and only once it no longer ends in U+FFFD, so a character still
arriving is held back instead of streamed as a replacement character. The window keeps a few
earlier tokens so decoders that treat the first token specially (leading-space handling) see
the same context as a full decode would.

Where the tokenizer is a `tokenizers.Tokenizer` (pdserve's `Tokenizer.hf`), each step runs in the library's own
`DecodeStream`, the same scheme in Rust: one call a token instead of two decodes and the slicing around them
(3.8 -> 1.7 us a token on a Zen 4; docs/engine.md, "Host overhead"). The offsets are still kept here, as the
stream moves them, because `flush` (which the stream lacks) decodes the window itself, and because a step the
stream refuses (its prefix check: a decoder whose text for the window does not extend the previous one) falls
back to the two decodes from the same window, for the rest of the sequence.
"""
from __future__ import annotations

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

_CONTEXT = 5  # tokens of the prompt kept as left context for the first decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        ctx = list(prompt_token_ids or [])[-_CONTEXT:]
        self.ids: list[int] = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        hf = getattr(tokenizer, "hf", None)
        self._hf = hf if isinstance(hf, _HFTokenizer) else None
        self._stream = DecodeStream(ids=ctx, skip_special_tokens=skip_special_tokens) if self._hf else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Add one token; return the newly stable text (possibly '')."""
        token_id = int(token_id)
        if self._stream is not None:
            try:
                delta = self._stream.step(self._hf, token_id)
            except Exception:  # the stream's prefix check refused this window: decode it here from now on
                self._stream = None
            else:
                self.ids.append(token_id)
                if delta:  # the stream moved its window: so do the offsets (flush and a fallback read them)
                    self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                    self._trim()
                return delta or ""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new, or a multi-byte character is still incomplete
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._trim()
        return delta

    def flush(self) -> str:
        """Everything not yet returned (at the end of the sequence; may contain U+FFFD if the
        model really produced an invalid byte sequence)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def _trim(self) -> None:
        # Tokens before prefix_offset are never decoded again; drop them to keep memory O(window).
        if self.prefix_offset > 64:
            cut = self.prefix_offset
            self.ids = self.ids[cut:]
            self.prefix_offset -= cut
            self.read_offset -= cut
