"""`--speculative ngram|draft --num-speculative-tokens K [--draft-model DIR]` for `pdserve worker` / `up` /
`generate` (env PDSERVE_SPECULATIVE, ... through cli_args)."""
from __future__ import annotations

import argparse

METHODS = ("ngram", "draft")


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", choices=METHODS,
                   help="speculative decoding: ngram (prompt lookup, no second model) or draft (--draft-model); "
                        "default: off (docs/engine.md)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="candidates verified per decode step (default: 4)")
    p.add_argument("--draft-model", help="draft checkpoint dir for --speculative draft (same tokenizer)")


def spec_config(args) -> dict:
    """EngineConfig fields from the flags (only those given)."""
    kw = {}
    if getattr(args, "speculative", None):
        kw["speculative"] = args.speculative
    if getattr(args, "num_speculative_tokens", None) is not None:
        kw["num_speculative_tokens"] = args.num_speculative_tokens
    if getattr(args, "draft_model", None):
        kw["draft_model"] = args.draft_model
    return kw
