"""The request progress bar of `pdserve bench run | sweep | breakeven` (its own module: breakeven.py and cli.py
both use it, and cli.py imports breakeven.py)."""
from __future__ import annotations


class Progress:
    """rich progress bar over requests (or a no-op)."""

    def __init__(self, enabled: bool):
        self.p = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as P
            self.p = P(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       transient=False)

    def __enter__(self):
        if self.p:
            self.p.__enter__()
        return self

    def __exit__(self, *exc):
        if self.p:
            self.p.__exit__(*exc)

    def task(self, desc: str, total: int):
        if not self.p:
            return lambda rec: None
        tid = self.p.add_task(desc, total=total)
        return lambda rec: self.p.advance(tid)
