"""The prefix-cache block hash is a wire value: routers and other workers compare it (router/prefix_index.py, the
KV tier's keys), so its bytes must not change with how they are built. Reference: the chain written out with
hashlib and int.to_bytes, one token at a time."""
from __future__ import annotations

import hashlib
import random

import pytest

from pdserve.engine.block_manager import block_hash


def _reference(parent, tokens, fingerprint, namespace):
    h = hashlib.blake2b(digest_size=8)
    h.update(b"root" if parent is None else parent.to_bytes(8, "little"))
    if parent is None:
        h.update(fingerprint.encode())
        h.update(b"\x00" + namespace.encode())
    for t in tokens:
        h.update(t.to_bytes(4, "little", signed=False))
    return int.from_bytes(h.digest(), "little")


def test_block_hash_equals_the_byte_layout():
    rng = random.Random(0)
    parent = None
    for n in (16, 16, 1, 7, 0, 16):
        toks = [rng.randrange(0, 2**32) for _ in range(n)]
        assert block_hash(parent, toks, "fp", "tenant") == _reference(parent, toks, "fp", "tenant")
        assert block_hash(parent, tuple(toks), "fp", "tenant") == _reference(parent, toks, "fp", "tenant")
        parent = block_hash(parent, toks, "fp", "tenant")


def test_block_hash_refuses_token_ids_outside_uint32():
    with pytest.raises(Exception):
        block_hash(None, [2**32], "fp", "")
    with pytest.raises(Exception):
        block_hash(None, [-1], "fp", "")
