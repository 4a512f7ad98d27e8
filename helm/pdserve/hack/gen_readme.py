"""Regenerate the values table in helm/pdserve/README.md from the `# --` comments in values.yaml.

Run from the repository root: python helm/pdserve/hack/gen_readme.py   (tests/helm checks the table is current)
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- values-table:begin -->", "<!-- values-table:end -->"


def rows(values_text: str) -> list[tuple[str, str, str]]:
    data = yaml.safe_load(values_text)
    out, stack, doc = [], [], []
    for line in values_text.splitlines():
        s = line.strip()
        if s.startswith("# --"):
            doc = [s[4:].strip()]
            continue
        if s.startswith("#") and doc:
            doc.append(s[1:].strip())
            continue
        m = re.match(r"^( *)([A-Za-z0-9_.\-/\"]+):", line)
        if not m or line.lstrip().startswith("-"):
            continue
        indent, key = len(m.group(1)) // 2, m.group(2).strip('"')
        stack = stack[:indent] + [key]
        if doc:
            node = data
            for k in stack:
                node = node[k]
            default = json.dumps(node) if not isinstance(node, str) else json.dumps(node)
            out.append((".".join(stack), default, " ".join(doc)))
        doc = []
    return out


def table() -> str:
    lines = ["| key | default | description |", "| --- | --- | --- |"]
    for key, default, desc in rows((CHART / "values.yaml").read_text()):
        default = default if len(default) <= 60 else default[:57] + "..."
        lines.append(f"| `{key}` | `{default.replace('|', '&#124;')}` | {desc.replace('|', '&#124;')} |")
    return "\n".join(lines)


def render(readme: str) -> str:
    a, b = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:a] + "\n" + table() + "\n" + readme[b:]


if __name__ == "__main__":
    p = CHART / "README.md"
    p.write_text(render(p.read_text()))
    print(f"wrote {p}")
