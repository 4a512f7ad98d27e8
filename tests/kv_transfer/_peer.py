"""A peer process owning a KV tensor: sends its KVRegion, then reports the notifications it receives."""

import torch

from pdserve.kv_transfer.agent import KVAgent

SHAPE = (32, 2, 2, 4, 2, 8)  # [num_blocks, layers, K/V, block_size, kv_heads, head_dim]


def layout(**over):
    d = dict(fingerprint="fp-test", block_size=4, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
             block_bytes=2 * 2 * 4 * 2 * 8 * 4)
    d.update(over)
    return d


def content(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g)


def serve(conn, name: str, seed: int, layout_over: dict):
    kv = content(seed)
    agent = KVAgent(name, kv, layout(**layout_over))
    agent.start_pump(lambda m: conn.send([m]))
    conn.send(agent.region())
    conn.poll(60)  # until the test says stop
