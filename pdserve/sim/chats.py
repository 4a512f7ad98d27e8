"""A prefix-heavy workload for routing studies: shared system prompts and multi-turn chats.

`groups` system prompts with Zipf popularity; each request is the next turn of one of `chats_per_group` chats
of its group, so its prompt is the group's system prompt + the chat's history + a new user message. Prompts
are token ids (`RequestSpec`, what `Cluster.run` consumes).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.bench.workload import RequestSpec


@dataclass
class ChatWorkload:
    groups: int = 16
    system_tokens: int = 512
    chats_per_group: int = 6
    user_tokens: int = 48
    out_tokens: int = 32
    zipf: float = 0.8
    rate: float = 40.0  # requests / s (Poisson)
    n: int = 600
    seed: int = 0
    shared_system: bool = False  # one system prompt for everyone (the herding case)
    max_prompt_tokens: int = 3000  # a chat that would grow past this starts over

    def generate(self) -> list[RequestSpec]:
        rng = random.Random(self.seed)
        systems = [[rng.randrange(1, 30000) for _ in range(self.system_tokens)] for _ in range(self.groups)]
        if self.shared_system:
            systems = [systems[0]] * self.groups
        weights = [1.0 / (g + 1) ** self.zipf for g in range(self.groups)]
        chats: dict[tuple[int, int], list[int]] = {}
        t = 0.0
        out = []
        for i in range(self.n):
            t += rng.expovariate(self.rate)
            g = rng.choices(range(self.groups), weights)[0]
            hist = chats.setdefault((g, rng.randrange(self.chats_per_group)), [])
            user = [rng.randrange(1, 30000) for _ in range(self.user_tokens)]
            prompt = systems[g] + hist + user
            if len(prompt) > self.max_prompt_tokens:
                hist.clear()
                prompt = systems[g] + user
            answer = [rng.randrange(1, 30000) for _ in range(self.out_tokens)]
            hist.extend(user + answer)  # the next turn carries this one (multi-turn prefix reuse)
            out.append(RequestSpec(i, t, prompt, len(prompt), self.out_tokens))
        return out
