"""A worker's grammar compiler: constraints compile in child processes, under a deadline, before the request
reaches the engine (docs/reliability.md, "Hostile neighbours").

Why not on the engine thread (where it ran until this module): a client controls a schema's compile time, and a
compile there froze every request on the worker (a 60k-value enum: ~100 s; the worker left the registry). Why
processes (grammar_child.py) and not threads: xgrammar releases the GIL while it compiles, so a thread would not
stall the engine, but nothing can stop it; a process past its deadline is killed and replaced. What a process
costs: serializing the compiled grammar to the worker (~3 ms for a 2,000-value enum, 148 KB) and ~300 MB of
memory each (xgrammar imports torch).

The order of a guided request: limits (grammar_limits.py: a refusal costs no compile), the cache (keyed by the
constraint's canonical text, bounded in bytes), a free process (waiting counts against the deadline), the
compile (deadline: min(the request's deadline, now + --grammar-compile-timeout)). Only then does the request take
a sequence slot or KV. A caller that goes away (client disconnect, the gateway's deadline) cancels the await, and
the process compiling for it is killed.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Callable

from pdserve.engine.grammar import grammar_source, tokenizer_info
from pdserve.engine.grammar_child import read_frame, write_frame
from pdserve.engine.grammar_limits import GrammarLimits, LimitExceeded, check
from pdserve.engine.sampling_params import GuidedSpec, InvalidParameter

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger("pdserve.grammar")

DEFAULT_PROCESSES = 2  # one compile may be killed (and its replacement start, ~3.5 s) while another goes on
DEFAULT_CACHE_BYTES = 256 << 20


class CompileTimeout(Exception):
    """No compiled grammar in time, through no fault of the constraint: `why` is "deadline" (the request's own
    deadline passed) or "busy" (no compiler was free in time). A constraint that itself compiles longer than
    --grammar-compile-timeout is the client's doing: CompileTooSlow, an InvalidParameter (a 400)."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


class CompileTooSlow(LimitExceeded):
    pass


class _Child:
    """One compiler process; its pipes are used from one pool thread at a time."""

    def __init__(self, hello: Callable[[], bytes]):
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.engine.grammar_child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, close_fds=True)
        self._hello: Callable[[], bytes] | None = hello
        self._lock = threading.Lock()
        self.ready = None  # the pool's future of greet()

    def greet(self) -> None:
        """Blocking (a pool thread): hand the child its tokenizer, once, and wait until it says it is ready (its
        imports take ~3.5 s), so that no compile's deadline counts its start-up. Never on the event loop."""
        with self._lock:
            if self._hello is not None:
                write_frame(self.proc.stdin, self._hello())
                self.proc.stdin.flush()
                self._hello = None
                if read_frame(self.proc.stdout) is None:
                    raise OSError(f"the grammar compiler process exited at start ({self.proc.poll()})")

    def roundtrip(self, job: bytes, info: Callable[[], xgr.TokenizerInfo]):
        """Blocking (a pool thread): send one job, read its answer. Killing the process ends the read (EOF)."""
        try:
            self.greet()
            write_frame(self.proc.stdin, job)
            self.proc.stdin.flush()
            head = read_frame(self.proc.stdout)
            if head is None:
                return None
            res = json.loads(head)
            if not res["ok"]:
                return res
            blob = read_frame(self.proc.stdout)
            if blob is None:
                return None
            import xgrammar as xgr  # on first use, as in grammar.py

            return {**res, "compiled": xgr.CompiledGrammar.deserialize_json(blob.decode(), info())}
        except (OSError, ValueError):  # a killed child: broken pipe, or a read on a closed file
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class _Cache:
    """Compiled grammars by canonical constraint, least recently used out first, bounded in bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self._items: OrderedDict[tuple, tuple[xgr.CompiledGrammar, int]] = OrderedDict()

    def get(self, key: tuple) -> xgr.CompiledGrammar | None:
        hit = self._items.get(key)
        if hit is None:
            return None
        self._items.move_to_end(key)
        return hit[0]

    def put(self, key: tuple, compiled: xgr.CompiledGrammar) -> None:
        size = int(compiled.memory_size_bytes) + sum(len(str(t)) for t in key)
        if key in self._items or size > self.max_bytes:
            return
        self._items[key] = (compiled, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, s) = self._items.popitem(last=False)
            self.bytes -= s

    def __len__(self) -> int:
        return len(self._items)


class GrammarPool:
    def __init__(self, tokenizer, vocab_size: int, limits: GrammarLimits | None = None,
                 processes: int = DEFAULT_PROCESSES, cache_bytes: int = DEFAULT_CACHE_BYTES, observe=None):
        """`observe(outcome, seconds)`: a metrics hook; outcome: ok, cached, over_limit, invalid, timeout (over
        --grammar-compile-timeout), deadline, busy, cancelled."""
        self.limits = limits or GrammarLimits()
        self.processes = max(1, processes)
        self._vocab = (tokenizer, vocab_size)
        self._vocab_lock = threading.Lock()
        self._vocab_info: tuple[xgr.TokenizerInfo, bytes] | None = None
        self.cache = _Cache(cache_bytes)
        self.observe = observe or (lambda outcome, seconds: None)
        self._idle: asyncio.Queue[_Child] | None = None
        self._pending = 0  # processes not started yet (started lazily)
        self._all: set[_Child] = set()
        self._threads = ThreadPoolExecutor(self.processes, thread_name_prefix="pdserve-grammar",
                                           initializer=_lowest_priority)
        self.kills = 0

    def _info(self) -> xgr.TokenizerInfo:
        """Blocking (pool threads only, never the event loop): xgrammar's vocabulary of the tokenizer, built on the
        first need (xgrammar's and transformers' imports take ~1.5 s, which a worker that never sees a grammar
        does not pay at start)."""
        with self._vocab_lock:
            if self._vocab_info is None:
                info = tokenizer_info(*self._vocab)
                hello = json.dumps({"tokenizer_info": info.serialize_json(), "limits": asdict(self.limits)})
                self._vocab_info = (info, hello.encode())
            return self._vocab_info[0]

    def _hello(self) -> bytes:
        self._info()
        return self._vocab_info[1]

    def start(self, lazy: bool = False) -> None:
        """Start the compiler processes (their start-up, ~3.5 s of imports, overlaps whatever the caller does);
        `lazy`: at the first compile instead, which then waits for one to start (within its request's deadline)."""
        self._idle = asyncio.Queue()
        self._pending = self.processes if lazy else 0
        if not lazy:
            self._spawn_pending(self.processes)

    def _spawn_pending(self, n: int) -> None:
        for _ in range(n):
            self._idle.put_nowait(self._spawn())

    def _spawn(self) -> _Child:
        child = _Child(self._hello)
        self._all.add(child)
        child.ready = self._threads.submit(child.greet)  # its imports overlap the wait for the next job
        return child

    def _replace(self, child: _Child) -> None:
        """A child that ran out of time (or whose caller left) mid-compile: kill it, start another."""
        self.kills += 1
        self._all.discard(child)
        child.kill()
        self._idle.put_nowait(self._spawn())

    def close(self) -> None:
        for child in list(self._all):
            child.kill()
        self._all.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)

    async def compile(self, spec: GuidedSpec, deadline: float | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar for `spec`; `deadline`: the request's (unix time). Raises InvalidParameter (the
        constraint is invalid or over a limit) or CompileTimeout; a cancelled await kills its compile."""
        t0 = time.perf_counter()
        outcome = "cancelled"
        try:
            check(spec, self.limits)
            kind, text = grammar_source(spec)
            key = (kind, text)
            compiled = self.cache.get(key)
            if compiled is not None:
                outcome = "cached"
                return compiled
            compiled = await self._compile(kind, text, deadline)
            self.cache.put(key, compiled)
            outcome = "ok"
            return compiled
        except CompileTooSlow:
            outcome = "timeout"
            raise
        except LimitExceeded:
            outcome = "over_limit"
            raise
        except InvalidParameter:
            outcome = "invalid"
            raise
        except CompileTimeout as e:
            outcome = e.why
            raise
        finally:
            self.observe(outcome, time.perf_counter() - t0)

    async def _compile(self, kind: str, text, deadline: float | None) -> xgr.CompiledGrammar:
        def left() -> float:
            return float("inf") if deadline is None else deadline - time.time()

        cap = self.limits.grammar_compile_timeout
        if self._pending:  # started lazily: the first compile starts them all
            n, self._pending = self._pending, 0
            self._spawn_pending(n)
        try:  # a free compiler: waiting is bounded by the request, and by one compile's cap
            child = await asyncio.wait_for(self._idle.get(), max(0.0, min(left(), cap)))
        except TimeoutError:
            raise CompileTimeout("every grammar compiler was busy", "deadline" if left() <= 0 else "busy") from None
        await self._started(child, left)
        why = "deadline" if left() <= cap else "cap"
        end = time.monotonic() + min(left(), cap)
        job = json.dumps({"kind": kind, "text": list(text) if kind == "wrapped_json" else text}).encode()
        fut = asyncio.get_running_loop().run_in_executor(self._threads, child.roundtrip, job, self._info)
        try:
            res = await asyncio.wait_for(asyncio.shield(fut), max(0.0, end - time.monotonic()))
        except TimeoutError:
            self._replace(child)
            if why == "deadline":
                raise CompileTimeout("the request's deadline passed while its grammar compiled", why) from None
            raise CompileTooSlow(f"guided.{_field(kind)}", f"it did not compile within {cap:g} s, this server's "
                                 "limit (--grammar-compile-timeout)") from None
        except BaseException:  # cancelled: the caller is gone, and so is its compile
            self._replace(child)
            raise
        if res is None:  # the child died on its own (out of memory, a crash in xgrammar)
            self._replace(child)
            raise InvalidParameter(f"guided.{_field(kind)}", "the grammar compiler failed on this constraint")
        self._idle.put_nowait(child)
        if not res["ok"]:
            raise InvalidParameter(res["param"], res["why"])
        return res["compiled"]


    async def _started(self, child: _Child, left) -> None:
        """Wait for `child` to finish starting (its start-up is not the compile's time; only the request's
        deadline bounds it). A child that could not start is replaced."""
        wait = left()
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(child.ready)),
                                   None if wait == float("inf") else max(0.0, wait))
        except TimeoutError:
            self._idle.put_nowait(child)  # it goes on starting, for the next job
            raise CompileTimeout("the request's deadline passed while a grammar compiler started", "deadline") \
                from None
        except asyncio.CancelledError:
            self._idle.put_nowait(child)
            raise
        except Exception as e:  # noqa: BLE001 - it died before it could read its tokenizer
            log.error("a grammar compiler process failed to start: %s", e)
            self._replace(child)
            raise CompileTimeout("no grammar compiler could start", "busy") from None


def _lowest_priority() -> None:
    """This pool thread (it reads and deserializes compiled grammars: 2.3 s of CPU for a 20k-value enum's 26 MB)
    at nice 19, as the compiler processes run: Linux takes a thread id for a process id here."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _field(kind: str) -> str:
    return {"json_object": "json_schema", "wrapped_json": "grammar"}.get(kind, kind)
