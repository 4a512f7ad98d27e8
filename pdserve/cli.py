"""The `pdserve` command."""
from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="prefill/decode disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    from pdserve.engine.cli_generate import add_generate_parser
    add_generate_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args) or 0)
