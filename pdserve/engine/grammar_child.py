"""One grammar-compiling process of a worker's GrammarPool (`python -m pdserve.engine.grammar_child`).

A process, not a thread, because a compile must be stoppable: xgrammar cannot be interrupted, and a compile past
its deadline would otherwise burn a core for as long as the client's schema makes it (~100 s seen). The pool
kills this process instead and starts another. It runs at the lowest CPU priority (nice 19) and one xgrammar
thread, so on a small host a compile takes what the engine threads leave.

Frames on stdin/stdout, each an 8-byte big-endian length and its bytes:
  in:  first {"tokenizer_info": <TokenizerInfo JSON>, "limits": {...}}; then per job {"kind": ..., "text": ...}
  out: {"ready": true} once set up; per job {"ok": true, "seconds": s} and a frame of the CompiledGrammar's JSON, or
       {"ok": false, "param": ..., "why": ...} (the client's constraint is invalid or over a limit)
"""
from __future__ import annotations

import json
import os
import struct
import sys
import time

_LEN = struct.Struct(">Q")


def read_frame(f) -> bytes | None:
    head = f.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    data = f.read(n)
    if len(data) < n:
        return None
    return data


def write_frame(f, data: bytes) -> None:
    f.write(_LEN.pack(len(data)))
    f.write(data)


def serve(inp, out) -> None:
    import xgrammar as xgr

    from pdserve.engine.grammar import compile_source
    from pdserve.engine.grammar_limits import GrammarLimits
    from pdserve.engine.sampling_params import InvalidParameter

    hello = read_frame(inp)
    if hello is None:
        return
    cfg = json.loads(hello)
    info = xgr.TokenizerInfo.deserialize_json(cfg["tokenizer_info"])
    limits = GrammarLimits(**cfg["limits"])
    # the pool keeps the cache (bounded, shared by every child's results): none here
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    write_frame(out, b'{"ready": true}')  # the pool times compiles from here: start-up is not a compile
    out.flush()
    while (job := read_frame(inp)) is not None:
        req = json.loads(job)
        text = tuple(req["text"]) if req["kind"] == "wrapped_json" else req["text"]
        t0 = time.perf_counter()
        try:
            compiled = compile_source(compiler, req["kind"], text, limits)
        except InvalidParameter as e:
            write_frame(out, json.dumps({"ok": False, "param": e.param, "why": e.why}).encode())
        else:
            blob = compiled.serialize_json().encode()
            write_frame(out, json.dumps({"ok": True, "seconds": time.perf_counter() - t0}).encode())
            write_frame(out, blob)
        out.flush()


if __name__ == "__main__":
    # The channel is the original stdout; anything a library prints goes to stderr instead of corrupting it.
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    try:
        os.nice(19)  # the lowest priority: a compile gets what the engine threads leave
    except OSError:
        pass
    serve(sys.stdin.buffer, channel)
