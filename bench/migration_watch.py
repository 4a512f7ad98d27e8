"""What watching a worker's stream for silence costs the gateway per relayed message (gateway/migration.py).

Three readers of the same in-process stream (a message per event-loop turn, as a worker's tokens arrive), side by
side: a plain `async for` (the peer: what the relay did before migration), `watched` (one watchdog task per
stream, the shipped design), and a per-message `asyncio.wait(read, timeout)` (the first design, kept here as the
figure that made us drop it). Prints the CPU and microseconds per message and the ratios to the plain read.

    python bench/migration_watch.py [--messages 20000]
"""
from __future__ import annotations

import argparse
import asyncio
import time

import grpc

from pdserve.engine import cpu_isa
from pdserve.services.gateway.migration import STALL_CHECK_S, watched


class Stream:
    """A stream of `n` messages, each ready one event-loop turn after it is asked for."""

    def __init__(self, n: int):
        self.n = n

    async def read(self):
        await asyncio.sleep(0)
        if self.n == 0:
            return grpc.aio.EOF
        self.n -= 1
        return 1

    def __aiter__(self):
        return self

    async def __anext__(self):
        m = await self.read()
        if m is grpc.aio.EOF:
            raise StopAsyncIteration
        return m

    def cancel(self) -> None:
        pass


async def listed(worker_id: str) -> bool:
    return True


async def per_message_timeout(call):
    while True:
        read = asyncio.ensure_future(call.read())
        while not (await asyncio.wait({read}, timeout=STALL_CHECK_S))[0]:
            pass
        m = read.result()
        if m is grpc.aio.EOF:
            return
        yield m


async def run(n: int) -> dict[str, float]:
    readers = {"plain": lambda: Stream(n), "watched": lambda: watched(Stream(n), "w", listed),
               "per-message wait": lambda: per_message_timeout(Stream(n))}
    best = {k: float("inf") for k in readers}
    for _ in range(3):  # best of 3: the box is shared
        for name, make in readers.items():
            t = time.perf_counter()
            async for _ in make():
                pass
            best[name] = min(best[name], (time.perf_counter() - t) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=20000)
    a = ap.parse_args()
    flags = cpu_isa.cpu_flags()
    shown = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    print(f"cpu: {cpu_isa.cpu_model()}; flags: {' '.join(shown) or '-'}")
    best = asyncio.run(run(a.messages))
    for name, v in best.items():
        print(f"{name:>17}: {v * 1e6:6.1f} us/message  ({v / best['plain']:.2f}x plain)")


if __name__ == "__main__":
    main()
