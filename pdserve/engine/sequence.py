"""A sequence is one branch of a request: its tokens, its blocks, its place in the state machine."""
from __future__ import annotations

import time
from typing import Any

from pdserve.engine.request_state import ENTERED, RequestState, check_transition


class Sequence:
    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], namespace: str = "",
                 branch: int = 0, arrival_time: float | None = None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.branch = branch
        self.namespace = namespace
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in this sequence's blocks
        self.num_cached_tokens = 0  # of which came from the prefix cache
        self.num_prompt_lookups = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.host_table: list[int] = []
        self.num_released_blocks = 0  # leading block-table entries released out of every layer's window (HOLE)
        self.state: RequestState | None = None
        self.finished = False  # state is terminal: kept by set_state, read several times a token
        self.history: list[RequestState] = []
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.priority = 0  # lower = more urgent (policy `priority`; also orders preemption victims)
        self.predicted_output_tokens = 0  # policy `shortest-predicted-first`
        self.paused = False  # backpressured: its consumer is behind, so no ticks are spent on it
        # Filled by the engine: sampling state, output processor, per-branch results.
        self.sampling: Any = None
        self.output: Any = None
        self.text = ""
        self.new_text = ""
        self.new_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.logprobs: list = []
        self.num_preemptions = 0
        self.wants_prompt_logprobs = False  # prompt logprobs need every position computed: no prefix hits
        self.prompt_logit_rows: list = []
        # Speculative decoding (spec_decode/): this tick's candidates, and the Q16 counts over decode steps.
        self.draft_token_ids: list[int] = []
        self.num_verified_tokens = 0  # positions the target forwarded in decode steps
        self.num_accepted_tokens = 0  # speculative candidates accepted
        self.num_kv_growth_tokens = 0  # decode positions whose KV stayed committed (not rolled back)

    def set_state(self, new: RequestState) -> None:
        check_transition(self.state, new)
        self.state = new
        self.finished = new.terminal
        self.history.append(new)
        ENTERED[new.value] += 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefill(self) -> bool:
        """No token sampled yet, or more than one token lacks KV (a recompute after preemption)."""
        return self.num_output_tokens == 0 or self.num_tokens - self.num_computed_tokens > 1

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}#{self.branch}, {self.state}, {self.num_computed_tokens}/{self.num_tokens})"
