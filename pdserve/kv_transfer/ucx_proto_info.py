"""UCX's report of the protocols it selected (`UCX_PROTO_INFO`), read back: which transport carried the READs.

UCX decides per endpoint configuration (the lanes it wired to a peer: `cfg#N`, on one host `intra-node`, across
hosts `inter-node`) and per operation which protocol and transport serve each message size. With UCX_PROTO_INFO
set to a glob of operations it logs that decision as a table the first time it makes it, e.g. for a READ between
two processes of one host with UCX's defaults:

    +--------+-------------+-------------------------------------------+
    | me intra-node cfg#1                                              |
    | remote memory read by ucp_get*(multi) into host memory from host |
    +--------+-------------+-------------------------------------------+
    | Range  | Description |                  Config                   |
    +--------+-------------+-------------------------------------------+
    | 0..inf | zero-copy   | cma/memory                                |
    +--------+-------------+-------------------------------------------+

(`me`: the UCX worker's name, the NIXL agent's; Config: `transport/device`, several where UCX splits a range over
lanes). With UCX_TLS=tcp the row reads `software emulation | tcp/lo`: the READ is emulated over TCP messages.
This module turns such lines into `Selection`s and says, from a peer's, which transport its READs took. It reads
UCX's own words, not the configuration; a table it cannot read is skipped, and a peer it cannot place is `unknown`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

UNKNOWN = "unknown"
READ_OP = "remote memory read"  # ucp_get*: what a NIXL READ is to UCX
_PREFIX = re.compile(r"^\[[^\]]*\]\s+\[[^\]]*\]\s?(.*)$")  # "[time] [host:pid:thread]  message"
_TITLE = re.compile(r"^\|\s*(.*?)\s+(\S+)\s+cfg#(\d+)\s*\|$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/\S")  # "cma/memory", "tcp/eth0", "rc_mlx5/mlx5_0:1"


@dataclass(frozen=True)
class Selection:
    worker: str      # the UCX worker's name: the NIXL agent that selected it
    locality: str    # self | intra-node | inter-node
    cfg: int         # the endpoint configuration's index in that worker
    op: str          # "remote memory read by ucp_get*(multi) into host memory from host", ...
    transports: tuple[str, ...]  # every transport a size range of the table uses, sorted

    @property
    def is_read(self) -> bool:
        return self.op.startswith(READ_OP)


def message(line: str) -> str:
    """A UCX log line without its `[time] [host:pid:thread]` prefix (the line as is when it has none)."""
    m = _PREFIX.match(line)
    return (m.group(1) if m else line).strip()


def is_table_line(msg: str) -> bool:
    return msg.startswith("|") or msg.startswith("+-")


class TableParser:
    """Feed it UCX log messages one by one (`feed`); it returns a Selection when a table ends. A table is four
    border lines apart: top, below the title, below the column names, bottom; a line that is no table's resets
    it, and a title line starts a table afresh (after one that was cut short)."""

    def __init__(self):
        self._lines: list[str] = []
        self._borders = 0

    def feed(self, msg: str) -> Selection | None:
        if not is_table_line(msg):
            self._lines, self._borders = [], 0
            return None
        if msg.startswith("+-"):
            self._borders += 1
            if self._borders == 4:
                got = parse_table(self._lines)
                self._lines, self._borders = [], 0
                return got
            return None
        if self._lines and _TITLE.match(msg):
            self._lines, self._borders = [], 1  # the border just before it was this table's top
        self._lines.append(msg)
        return None


def parse_table(rows: list[str]) -> Selection | None:
    """The `|` lines of one table (title, operation, column names, ranges) -> a Selection; None if not one."""
    if len(rows) < 4:
        return None
    title = _TITLE.match(rows[0])
    if title is None or not rows[1].startswith("|"):
        return None
    op = rows[1].strip("| ").strip()
    names = [c.strip() for c in rows[2].strip("|").split("|")]
    if not names or names[-1] != "Config":
        return None
    found: set[str] = set()
    for r in rows[3:]:
        cells = [c.strip() for c in r.strip("|").split("|")]
        if len(cells) != len(names):
            return None
        found.update(_TRANSPORT.findall(cells[-1]))
    if not found:
        return None
    return Selection(title.group(1), title.group(2), int(title.group(3)), op, tuple(sorted(found)))


def observed(worker: str, new: list[Selection], known: list[Selection]) -> str:
    """The transport(s) `worker`'s READs to one peer took, joined with '+' ("cma", "tcp", "rc_mlx5+tcp"), or
    UNKNOWN. `new`: the selections UCX reported between this peer's first contact and now (its endpoint
    configuration's, unless another new peer's first READs fell in the same window); `known`: every selection
    seen so far (a peer that reuses an endpoint configuration met before makes UCX report nothing new). Whatever
    the candidates, they must agree: two configurations that chose differently cannot be told apart here."""
    for pool in (new, known):
        reads = [s for s in pool if s.worker == worker and s.is_read and s.locality != "self"]
        if reads:
            by_cfg: dict[tuple[str, int], set[str]] = {}
            for s in reads:
                by_cfg.setdefault((s.locality, s.cfg), set()).update(s.transports)
            choices = {"+".join(sorted(t)) for t in by_cfg.values()}
            return choices.pop() if len(choices) == 1 else UNKNOWN
    return UNKNOWN
