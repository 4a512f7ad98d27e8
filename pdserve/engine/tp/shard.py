"""Which slice of every weight and of the KV heads a rank holds (spec D08: KV heads split across ranks, or
replicated when there are fewer of them than ranks; anything else cannot be split and is refused at load).

Rank r of N holds query heads [r*H/N, (r+1)*H/N). With K KV heads:
- K >= N (K % N == 0): KV heads [r*K/N, (r+1)*K/N), each rank a disjoint slice;
- K < N (N % K == 0): one KV head, r*K // N, held by N/K ranks (replicated): every query head of rank r maps to
  it because a group of H/K query heads spans exactly N/K ranks.
The MLP's intermediate dimension is split in N equal slices; the vocabulary in N slices of ceil(V/N) rows (the
last padded with zero rows whose logits are dropped after the gather).
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.errors import CheckpointError


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int
    heads: range  # query heads held
    kv_heads: range  # KV heads held (a replicated head appears on several ranks)
    inter: range  # rows of gate/up (and columns of down) held
    vocab: range  # rows of the embedding / LM head held (may run past the vocabulary on the last rank)
    vocab_size: int  # the real vocabulary (logits past it are padding)
    total_kv_heads: int  # the model's KV heads
    experts: range = range(0)  # the routed experts held (expert parallelism); empty for a dense model
    # Expert parallelism without tensor parallelism: attention (and its KV), the dense MLPs, the embedding and the
    # LM head are whole on every rank, computed on every rank over every token; only the routed experts are split.
    replicated: bool = False

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def check_tp(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int, num_experts: int = 0,
             expert_parallel: bool = False) -> None:
    """Raise CheckpointError naming the shapes when `size` ranks cannot split this model (D08). With
    `expert_parallel` the routed experts are split over the same ranks (whole experts per rank)."""
    if size < 1:
        raise CheckpointError(f"tensor parallel size must be >= 1, got {size}")
    problems = []
    if num_experts and size > 1 and not expert_parallel:  # engine/moe.py: TP does not slice an expert
        problems.append(f"the {num_experts} experts of a mixture-of-experts model are not sharded for tensor "
                        f"parallelism (run it with tensor_parallel_size=1, or shard whole experts over the ranks "
                        f"with expert_parallel_size={size})")
    if num_experts and expert_parallel and num_experts % size:
        problems.append(f"{num_experts} experts are not divisible by expert_parallel_size={size}")
    if num_heads % size:
        problems.append(f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={size}")
    if num_kv_heads >= size and num_kv_heads % size:
        problems.append(f"num_key_value_heads={num_kv_heads} is not divisible by tensor_parallel_size={size}")
    if num_kv_heads < size and size % num_kv_heads:
        problems.append(f"num_key_value_heads={num_kv_heads} < tensor_parallel_size={size} and does not divide it "
                        f"(a KV head can only be replicated on an equal number of ranks)")
    if intermediate_size % size:
        problems.append(f"intermediate_size={intermediate_size} is not divisible by tensor_parallel_size={size}")
    if problems:
        raise CheckpointError("cannot shard the model for tensor parallelism: " + "; ".join(problems))


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> range:
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // size
    return range(head, head + 1)


def shard_for(cfg, rank: int = 0, size: int = 1, expert_parallel: bool = False, replicated: bool = False) -> TPShard:
    """The shard of rank `rank` of `size` for ModelConfig `cfg` (CheckpointError when it cannot be split).
    `expert_parallel`: rank r holds experts [r * E / size, (r + 1) * E / size); otherwise every rank all of them
    (only valid at size 1, check_tp). `replicated` (with `expert_parallel`): only the experts are split; the rest
    of the model is whole on every rank."""
    if replicated:
        if not cfg.num_experts:
            raise CheckpointError(f"expert_parallel_size={size} needs a mixture-of-experts model: this one has no "
                                  f"routed experts")
        if cfg.num_experts % size:
            raise CheckpointError(f"cannot shard the model for expert parallelism: {cfg.num_experts} routed experts "
                                  f"are not divisible by expert_parallel_size={size}")
        per = cfg.num_experts // size
        return TPShard(rank, size, range(cfg.num_heads), range(cfg.num_kv_heads), range(cfg.intermediate_size),
                       range(cfg.vocab_size), cfg.vocab_size, cfg.num_kv_heads, range(rank * per, (rank + 1) * per),
                       replicated=True)
    check_tp(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, size, cfg.num_experts, expert_parallel)
    per = cfg.num_experts // size if expert_parallel else cfg.num_experts
    experts = range(rank * per, (rank + 1) * per) if expert_parallel else range(cfg.num_experts)
    h, inter = cfg.num_heads // size, cfg.intermediate_size // size
    v = -(-cfg.vocab_size // size)
    return TPShard(rank, size, range(rank * h, (rank + 1) * h), kv_head_range(cfg.num_kv_heads, rank, size),
                   range(rank * inter, (rank + 1) * inter), range(rank * v, (rank + 1) * v), cfg.vocab_size,
                   cfg.num_kv_heads, experts)
