"""A worker's grammar compiler (engine/grammar_pool.py): off the engine thread, within limits, under a deadline,
killable, cached.

Before: a schema whose compile takes seconds ran on the engine thread, and every
other request on the worker waited for it. Here such a compile runs while other requests stream, and their
latency is asserted.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import replace

import pytest
import torch
import xgrammar as xgr

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.grammar import compile_guided
from pdserve.engine.grammar_limits import GrammarLimits, LimitExceeded
from pdserve.engine.grammar_pool import CompileTimeout, CompileTooSlow, GrammarPool
from pdserve.engine.sampling_params import GuidedSpec, InvalidParameter, SamplingParams

V = 448
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"}, "k": {"enum": ["x", "y"]}},
          "required": ["name", "n"], "additionalProperties": False}
# Limits raised far enough to let a slow schema through to the compiler: what the deadline must then stop.
OPEN = GrammarLimits(max_schema_bytes=1 << 24, max_enum_values=1 << 20)


def enum_schema(n: int, tag: str = "7") -> str:
    return json.dumps({"enum": [f"{tag}{i}" for i in range(n)]})


def slow_schema() -> str:
    """Seconds of compile on any CPU we run on (7.6 s for 20k values on a 2-vCPU AMD EPYC)."""
    return enum_schema(20000, tag=str(time.monotonic_ns()))  # never in a cache


def run(coro):
    return asyncio.run(coro)


async def ready(pool: GrammarPool) -> None:
    """Every process started (start-up, ~3.5 s, is not what the tests time)."""
    await pool.compile(GuidedSpec(regex="[a-z]"))
    for child in list(pool._all):
        await asyncio.wrap_future(child.ready)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def same_language(a: xgr.CompiledGrammar, b: xgr.CompiledGrammar, seed: int = 0) -> int:
    """Masks equal step by step along a random walk through the language; returns the steps walked."""
    local, remote = xgr.GrammarMatcher(a), xgr.GrammarMatcher(b)
    gen = torch.Generator().manual_seed(seed)
    steps = 0
    while not local.is_terminated() and steps < 200:
        ma, mb = xgr.allocate_token_bitmask(1, V), xgr.allocate_token_bitmask(1, V)
        local.fill_next_token_bitmask(ma)
        remote.fill_next_token_bitmask(mb)
        assert torch.equal(ma, mb), f"masks differ at step {steps}"
        logits = torch.randn(1, V, generator=gen)
        xgr.apply_token_bitmask_inplace(logits, ma)
        tok = int(logits.argmax())
        assert local.accept_token(tok) and remote.accept_token(tok)
        steps += 1
    assert local.is_terminated() and remote.is_terminated()
    return steps


def test_pool_compiles_what_an_inline_compile_does_and_caches_it(bpe_tokenizer):
    """The grammar that crossed a process boundary allows exactly the tokens an in-process compile allows. The
    cache is keyed by the canonical schema (spacing does not matter, key order does: properties come out in
    schema order) and bounded in bytes."""
    seen = []
    spec = GuidedSpec(json_schema=json.dumps(SCHEMA))

    async def main():
        pool = GrammarPool(bpe_tokenizer, V, processes=1, cache_bytes=4 << 20,
                           observe=lambda outcome, s: seen.append(outcome))
        pool.start()
        try:
            a = await pool.compile(spec)
            b = await pool.compile(GuidedSpec(json_schema=json.dumps(SCHEMA, indent=4)))
            c = await pool.compile(GuidedSpec(json_schema=json.dumps(dict(reversed(list(SCHEMA.items()))))))
            for i in range(30):  # ~0.15-0.6 MB each: the 4 MiB cache must evict
                await pool.compile(GuidedSpec(json_schema=enum_schema(300, tag=f"t{i}-")))
            return a, b, c, pool.cache.bytes, len(pool.cache)
        finally:
            pool.close()

    a, b, c, nbytes, n = run(main())
    assert same_language(compile_guided(spec, bpe_tokenizer, V), a) > 3
    assert b is a and c is not a
    assert seen[:3] == ["ok", "cached", "ok"]
    assert 0 < nbytes <= 4 << 20 and n < 33


@pytest.mark.parametrize("spec,flag", [
    # 60k enum values, 650 KB: ~100 s of compile on the engine thread when unbounded
    (GuidedSpec(json_schema=enum_schema(60000)), "--max-schema-bytes"),
    (GuidedSpec(json_schema=enum_schema(1001)), "--max-enum-values"),
    (GuidedSpec(json_schema=json.dumps({"type": "string", "pattern": "a" * 1001})), "--max-pattern-chars"),
    (GuidedSpec(regex="a" * 1001), "--max-pattern-chars"),
    (GuidedSpec(grammar="root ::= " + " ".join(f"r{i}" for i in range(2001)) + "\n" +
                "\n".join(f'r{i} ::= "a"' for i in range(2001))), "--max-grammar-rules"),
])
def test_over_a_limit_is_refused_before_any_compile(bpe_tokenizer, spec, flag):
    seen = []

    async def main():
        pool = GrammarPool(bpe_tokenizer, V, processes=1, observe=lambda outcome, s: seen.append((outcome, s)))
        pool.start()
        try:
            with pytest.raises(LimitExceeded) as e:
                await pool.compile(spec)
            return e.value, pool.kills
        finally:
            pool.close()

    err, kills = run(main())
    assert flag in str(err) and err.param.startswith("guided.")
    assert kills == 0 and seen[0][0] == "over_limit" and seen[0][1] < 0.5


def test_nesting_depth_limit(bpe_tokenizer):
    """Arrays nested 320-450 deep compiled for 15-43 s; past 64 levels of JSON they are refused."""
    s: dict = {"type": "integer"}
    for _ in range(70):  # 71 levels of JSON objects
        s = {"type": "array", "items": s}
    pool = GrammarPool(bpe_tokenizer, V, processes=1)
    with pytest.raises(LimitExceeded, match="--max-schema-depth"):
        run(pool.compile(GuidedSpec(json_schema=json.dumps(s))))
    pool.close()


def test_invalid_constraint_and_one_over_the_cap(bpe_tokenizer):
    """A constraint the compiler refuses is a 400 naming the field, and the process lives on; one that compiles
    past --grammar-compile-timeout is refused too, its process killed and replaced."""
    async def main():
        pool = GrammarPool(bpe_tokenizer, V, replace(OPEN, grammar_compile_timeout=1.0), processes=1)
        pool.start()
        try:
            await ready(pool)
            with pytest.raises(InvalidParameter) as invalid:
                await pool.compile(GuidedSpec(regex="(("))
            (child,) = pool._all
            t0 = time.monotonic()
            with pytest.raises(CompileTooSlow) as slow:
                await pool.compile(GuidedSpec(json_schema=slow_schema()))
            took = time.monotonic() - t0
            after = await pool.compile(GuidedSpec(regex="[0-9]+"))  # a new process serves the next one
            return invalid.value, child.proc.pid, slow.value, took, pool.kills, after
        finally:
            pool.close()

    invalid, pid, slow, took, kills, after = run(main())
    assert invalid.param == "guided.regex" and "parenthesis" in invalid.why and "/project" not in invalid.why
    assert "--grammar-compile-timeout" in str(slow) and slow.param == "guided.json_schema"
    assert 0.9 < took < 2.0
    assert kills == 1 and not alive(pid) and after is not None


def test_request_deadline_and_a_caller_that_leaves_stop_the_compile(bpe_tokenizer):
    async def main():
        pool = GrammarPool(bpe_tokenizer, V, OPEN, processes=1)
        pool.start()
        try:
            await ready(pool)
            t0 = time.monotonic()
            with pytest.raises(CompileTimeout) as e:
                await pool.compile(GuidedSpec(json_schema=slow_schema()), deadline=time.time() + 0.5)
            took = time.monotonic() - t0
            await ready(pool)
            (child,) = pool._all
            task = asyncio.create_task(pool.compile(GuidedSpec(json_schema=slow_schema())))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return e.value.why, took, child.proc.pid, pool.kills
        finally:
            pool.close()

    why, took, pid, kills = run(main())
    assert why == "deadline" and 0.4 < took < 1.5
    assert kills == 2 and not alive(pid)


def test_a_slow_compile_does_not_stall_other_requests(tiny_llama):
    """While one request's grammar compiles for seconds, unconstrained requests on the
    same engine keep their latency (before: every one of them waited for the whole compile)."""
    eng = Engine.from_pretrained(tiny_llama, EngineConfig(block_size=4, num_gpu_blocks=256))
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    guided = SamplingParams(temperature=0, max_tokens=8, guided=GuidedSpec(json_schema=slow_schema()))

    async def main():
        pool = GrammarPool(eng.tokenizer, eng.model_config.vocab_size,
                           replace(OPEN, grammar_compile_timeout=3.0), processes=1)
        pool.start()
        aeng = AsyncEngine(eng, pool)
        await aeng.start()
        try:
            await ready(pool)

            async def attacker():
                async for _ in aeng.generate("slow", [5, 6, 7], guided):
                    pass

            task = asyncio.create_task(attacker())
            lat, i = [], 0
            while not task.done():
                t0 = time.monotonic()
                async for _ in aeng.generate(f"p{i}", [5, 6, 7, 8], plain):
                    pass
                lat.append(time.monotonic() - t0)
                i += 1
            with pytest.raises(CompileTooSlow):
                await task
            return lat
        finally:
            await aeng.stop()
            pool.close()

    lat = run(main())
    assert len(lat) > 10  # they ran throughout the ~3 s compile
    assert max(lat) < 0.5, f"a request took {max(lat):.2f} s while another's grammar compiled"


def test_lazy_start_spawns_no_process_until_the_first_compile(bpe_tokenizer):
    """--grammar-start lazy: a worker that never sees a constraint starts no compiler process; the first compile
    starts them all and waits for one within its deadline."""
    async def main():
        pool = GrammarPool(bpe_tokenizer, V, processes=2)
        pool.start(lazy=True)
        try:
            before = len(pool._all)
            g = await pool.compile(GuidedSpec(json_schema=json.dumps(SCHEMA)), deadline=time.time() + 60)
            return before, len(pool._all), g
        finally:
            pool.close()

    before, after, g = run(main())
    assert before == 0 and after == 2
    assert same_language(compile_guided(GuidedSpec(json_schema=json.dumps(SCHEMA)), bpe_tokenizer, V), g) > 3


def test_a_worker_without_grammars_never_imports_xgrammar():
    """Start-up cost: xgrammar imports transformers (~1.5 s of a worker's start, paid by every start of every
    worker, planner grows included). A worker's modules, its engine and a lazily started pool load neither; the
    first compile does, in a pool thread."""
    import subprocess
    import sys
    code = """
import sys
import pdserve.services.worker
from pdserve.engine.engine import Engine
from pdserve.engine.grammar_pool import GrammarPool
e = Engine.from_pretrained('builtin')
pool = GrammarPool(e.tokenizer, e.model_config.vocab_size)
print(sorted(m for m in ('xgrammar', 'transformers') if m in sys.modules))
pool._info()
print(sorted(m for m in ('xgrammar', 'transformers') if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "['transformers', 'xgrammar']"], out.stdout + out.stderr
