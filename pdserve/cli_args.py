"""The argument parser behind `pdserve`: environment variables parsed like flags, one-line errors, suggestions.

- A parser made with `env=True` (up, gateway, router, worker: what a pod runs) reads each flag not given on the
  command line from `PDSERVE_<FLAG>` (`--max-num-seqs` -> `PDSERVE_MAX_NUM_SEQS`). The value goes through the
  flag's own `type` and `choices` when the command line is parsed, not when the parser is built, so a bad value
  is an error that names the variable, and `--help` still works with it set.
- `--help` shows each flag's default and its variable.
- Errors are one line (`pdserve up: error: ...`), with the closest flag or command for a typo (argparse on
  Python 3.11 suggests nothing).
"""
from __future__ import annotations

import argparse
import copy
import difflib
import os
import re
import sys

ENV_PREFIX = "PDSERVE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_UNSET = object()  # stands for "not on the command line" while parsing


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


# ---- value types: the same check for a flag and for its environment variable ----------------------------------

def _number(kind, lo=None, hi=None, lo_open=False):
    what = {int: "an integer", float: "a number"}[kind]

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>' if lo_open else '>='} {lo}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"{text!r} must be <= {hi}")
        return v

    parse.__name__ = kind.__name__
    return parse


port = _number(int, 0, 65535)
positive_int = _number(int, 1)
nonneg_int = _number(int, 0)
positive_float = _number(float, 0, lo_open=True)
nonneg_float = _number(float, 0)
fraction = _number(float, 0, 1, lo_open=True)  # (0, 1]
context_len = _number(int, 2)  # a prompt token and an output token


def labels_arg(text: str) -> dict[str, str]:
    """`zone=a,node=n1,price=2` -> a dict (a worker's labels); empty text: none."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        k, eq, v = part.partition("=")
        if not eq or not k.strip() or not v.strip():
            raise argparse.ArgumentTypeError(f"{part!r} is not KEY=VALUE (e.g. zone=a,node=n1)")
        out[k.strip()] = v.strip()
    if "price" in out:
        try:
            if float(out["price"]) < 0:
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"price={out['price']!r} is not a number >= 0") from None
    return out


def list_arg(text: str) -> tuple[str, ...]:
    """`a.example,b.example` -> ("a.example", "b.example") (the gateway's --allowed-hosts / --allowed-origins)."""
    out = tuple(p.strip() for p in text.split(",") if p.strip())
    if any(any(c.isspace() for c in p) for p in out):
        raise argparse.ArgumentTypeError(f"{text!r}: names are separated by commas, without spaces inside")
    return out


WEIGHT_KEYS = ("zone", "node", "price", "fairness")


def weights_arg(text: str) -> dict[str, float]:
    """The router's `--weights zone=0.05,node=0.02,price=0,fairness=0` (numbers >= 0; keys from WEIGHT_KEYS)."""
    out: dict[str, float] = {}
    for k, v in labels_arg(text).items():
        if k not in WEIGHT_KEYS:
            raise argparse.ArgumentTypeError(f"unknown weight {k!r} (known: {', '.join(WEIGHT_KEYS)})")
        try:
            out[k] = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{k}={v!r} is not a number") from None
        if out[k] < 0:
            raise argparse.ArgumentTypeError(f"{k}={v!r} must be >= 0")
    return out


class HelpFormatter(argparse.HelpFormatter):
    """Appends `(default: X; env PDSERVE_Y)` to each flag's help."""

    env = False
    _ONLY_SUFFIX = "\0"  # stands in for a flag with no help text, which argparse would print nothing for

    def _suffix(self, action) -> str:
        if action.help is argparse.SUPPRESS or not action.option_strings or action.dest in ("help", "verbose"):
            return ""
        bits = []
        default = getattr(action, "pd_default", action.default)
        if not (default is None or default is argparse.SUPPRESS or default is False) and action.nargs != 0:
            bits.append(f"default: {default}")
        if self.env and _env_capable(action):
            name = env_name(action.dest)
            bits.append(f"env {name}" + (f"={os.environ[name]!r}" if name in os.environ else ""))
        return ("(" + "; ".join(bits) + ")").replace("%", "%%") if bits else ""  # argparse %-formats help

    def _format_action(self, action):
        if not action.help and self._suffix(action):
            action = copy.copy(action)
            action.help = self._ONLY_SUFFIX
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = "" if action.help == self._ONLY_SUFFIX else (action.help or "")
        suffix = self._suffix(action)
        return f"{text} {suffix}" if text and suffix else (text or suffix)

def _env_capable(action: argparse.Action) -> bool:
    return bool(action.option_strings) and action.dest not in ("help", "verbose") and \
        isinstance(action, (argparse._StoreAction, argparse._StoreConstAction)) and action.nargs in (None, "?", 0)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, env: bool = False, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        self.env = env  # before the base __init__, which already formats (its -h)
        super().__init__(*args, **kwargs)
        if self.add_help:  # the traceback switch works after the subcommand too (`pdserve up -v`)
            self.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                              help="on an error, print the full traceback too")

    def _get_formatter(self):
        f = super()._get_formatter()
        f.env = self.env
        return f

    # ---- environment variables ----------------------------------------------------------------------------------

    def parse_known_args(self, args=None, namespace=None):
        from_env = {}
        if self.env:
            for a in self._actions:
                if _env_capable(a) and env_name(a.dest) in os.environ:
                    from_env[a] = a.default
                    a.pd_default = a.default  # what --help shows while the sentinel stands in
                    a.default = _UNSET
        try:
            ns, extras = super().parse_known_args(args, namespace)
        finally:
            for a, default in from_env.items():
                a.default = default
        for a, default in from_env.items():
            if getattr(ns, a.dest, None) is _UNSET:
                setattr(ns, a.dest, self._env_value(a, default))
        if extras and not hasattr(ns, "_pd_parser"):
            ns._pd_parser = self  # the innermost parser that saw the unknown arguments: its flags are the candidates
        return ns, extras

    def _env_value(self, action: argparse.Action, default):
        name = env_name(action.dest)
        raw = os.environ[name]
        flag = action.option_strings[-1]
        if action.nargs == 0:  # a switch: PDSERVE_X=1/true/yes/on or 0/false/no/off
            if raw.strip().lower() in _TRUE:
                return action.const
            if raw.strip().lower() in _FALSE:
                return default
            self.error(f"{name}={raw!r} (for {flag}): expected one of 1, true, yes, on, 0, false, no, off")
        convert = self._registry_get("type", action.type, action.type)
        try:
            value = convert(raw) if callable(convert) else raw
        except argparse.ArgumentTypeError as e:
            self.error(f"{name}={raw!r} (for {flag}): {e}")
        except (TypeError, ValueError):
            self.error(f"{name}={raw!r} (for {flag}): not a valid {getattr(convert, '__name__', 'value')}")
        if action.choices is not None and value not in action.choices:
            self.error(f"{name}={raw!r} (for {flag}): choose from {', '.join(map(str, action.choices))}")
        return value

    # ---- errors -------------------------------------------------------------------------------------------------

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        where = ns.__dict__.pop("_pd_parser", self)
        if extras:
            where.error("unrecognized arguments: " + " ".join(extras) + _suggest_flags(where, extras))
        return ns

    def error(self, message: str):
        m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if m:
            choices = re.findall(r"'([^']*)'", m.group(2))
            close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.6)
            if close:
                message += f"; did you mean {close[0]!r}?"
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _suggest_flags(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    tips = []
    for token in extras:
        if token.startswith("--"):
            flag = token.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            if close:
                tips.append((flag, close[0]))
    if len(tips) == 1:
        return f"; did you mean {tips[0][1]}?"
    return ("; did you mean " + ", ".join(f"{c} (for {f})" for f, c in tips) + "?") if tips else ""

def print_error(prog: str, exc: BaseException, verbose: bool) -> None:
    """One line naming the problem; the traceback only when asked for (-v / --verbose)."""
    if verbose:
        import traceback
        traceback.print_exception(exc, file=sys.stderr)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    print(f"{prog}: error: {text}" + ("" if verbose else " (run with -v for the traceback)"), file=sys.stderr)
