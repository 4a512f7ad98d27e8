"""Environment-only settings are declared once (pdserve/env_knobs.py) and documented (docs/options.md)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve import env_knobs
from pdserve.cli import build_parser
from pdserve.cli_args import env_name

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for p in (ROOT / "pdserve").rglob("*.py") if "_proto" not in p.parts]
MARKERS = {"PDSERVE_UP", "PDSERVE_CHILD"}  # lines `up` prints on stdout, not variables
READ = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["'](PDSERVE_\w+)""")


def _flag_variables() -> set[str]:
    commands = build_parser()._subparsers._group_actions[0].choices.values()
    return {env_name(a.dest) for c in commands for a in c._actions if a.option_strings}


def test_no_module_reads_an_undeclared_variable():
    flags = _flag_variables()
    stray, undeclared = [], []
    for p in SOURCES:
        text = p.read_text()
        rel = p.relative_to(ROOT)
        if p.name not in ("env_knobs.py", "cli_args.py"):
            stray += [(str(rel), m) for m in READ.findall(text) if m in env_knobs.KNOBS]
        for name in re.findall(r"""["'](PDSERVE_[A-Z0-9_]*[A-Z0-9])["']""", text):
            if name not in env_knobs.KNOBS and name not in flags and name not in MARKERS:
                undeclared.append((str(rel), name))
    assert stray == [], "read these through env_knobs.get / enabled"
    assert undeclared == [], "declare these in env_knobs.KNOBS (or make them flags)"


def test_knobs_do_not_shadow_flags():
    assert set(env_knobs.KNOBS) & _flag_variables() == set()


def test_docs_list_every_knob():
    doc = (ROOT / "docs" / "options.md").read_text()
    rows = dict(re.findall(r"^\| `(PDSERVE_\w+)` \| `?([^|`]*)`? \|", doc, re.M))
    assert set(rows) == set(env_knobs.KNOBS)
    for name, knob in env_knobs.KNOBS.items():
        assert rows[name].strip() == (knob.default or "unset"), name


def test_get_and_enabled(monkeypatch):
    with pytest.raises(KeyError):
        env_knobs.get("PDSERVE_NOT_DECLARED")
    monkeypatch.delenv("PDSERVE_KV_HUGEPAGES", raising=False)
    assert env_knobs.enabled("PDSERVE_KV_HUGEPAGES")  # default "1"
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("PDSERVE_KV_HUGEPAGES", off)
        assert not env_knobs.enabled("PDSERVE_KV_HUGEPAGES")
    monkeypatch.setenv("PDSERVE_KV_HUGEPAGES", "")  # empty: the default
    assert env_knobs.enabled("PDSERVE_KV_HUGEPAGES")
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "DEBUG")
    assert env_knobs.get("PDSERVE_LOG_LEVEL") == "DEBUG"
