"""Tasks a component starts and owns (the gateway's dispatcher and lifecycle, the prefill and decode sides).

asyncio keeps only a weak reference to a task: one nobody holds can be collected mid-flight, and a shutdown that
does not know it cannot wait for it. An `OwnedTasks` holds each task until it ends, and `wait` / `cancel` are the
two ways a component's close lets them finish.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class OwnedTasks:
    def __init__(self, on_error: Callable[[BaseException], None] | None = None):
        """`on_error`: called with the exception of a task that failed (None: asyncio reports it, as for any task
        whose exception nobody retrieved)."""
        self._tasks: set[asyncio.Task] = set()
        self._on_error = on_error

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if self._on_error is not None and not task.cancelled() and task.exception() is not None:
            self._on_error(task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout_s: float | None = None) -> None:
        """Until the tasks running now have ended, or `timeout_s` passed (they keep running then)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    async def cancel(self) -> None:
        """Cancel every task, and those they start while being cancelled, and wait until all have ended."""
        while self._tasks:
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
