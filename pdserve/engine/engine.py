"""The engine every worker role shares: add requests, step the scheduler, stream outputs, reclaim once.

Terminal paths (finished, cancelled, timed out, failed) all go through `_reclaim`, which is idempotent: blocks
are released by refcount, the batch slot is left, and exactly one usage record is written (spec §1.7).
Usage counts: `generated` = tokens sampled by the model (all branches); `emitted` = tokens whose text reached
the caller's stream; `committed` = tokens in the returned choices (what is billed: best_of drops the losers).
"""
from __future__ import annotations

import itertools
import json
import logging
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch

from pdserve.engine import beam as beams
from pdserve.engine import resume
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.checkpoint import resolve_model_dir
from pdserve.engine.config import DTYPES, EngineConfig, ModelConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.cpu_isa import EngineInfo, choose_dtype, detected_level
from pdserve.engine.errors import RequestRejected
from pdserve.engine.grammar import make_grammar_state
from pdserve.engine.host_copy import to_device
from pdserve.engine.kernels import native_ops
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.kv_offload import KVOffload
from pdserve.engine.kv_quant import storage_dtype as kv_storage_dtype
from pdserve.engine.kv_sizing import CPU_DEFAULT_KV_BYTES, block_bytes_for, swap_blocks
from pdserve.engine.kv_sizing import num_blocks as kv_pool_blocks
from pdserve.engine.loader import load_state_dict
from pdserve.engine.model import LlamaModel
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.outputs import CompletionOutput, FirstToken, Prefix, RequestOutput, RequestTimes, UsageRecord
from pdserve.engine.quant import auto_weight_storage, keep_batch1_gemv, weights_label
from pdserve.engine.request import Request
from pdserve.engine.request_state import RequestState as S
from pdserve.engine.sampler import Sampler, SamplingState, bad_words_to_ids
from pdserve.engine.sampling_params import InvalidParameter, SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode import make_spec_decoder
from pdserve.engine.stats import EngineStats
from pdserve.engine.stop import OutputProcessor
from pdserve.engine.tokenizer import Tokenizer
from pdserve.engine.tp.dispatch import uses_all_to_all
from pdserve.engine.tp.kv_ops import RecordingKVCache
from pdserve.engine.tp.shard import shard_for

if TYPE_CHECKING:  # xgrammar (and the transformers it imports) loads on the first constrained request
    from xgrammar import CompiledGrammar

log = logging.getLogger("pdserve.engine")
usage_log = logging.getLogger("pdserve.usage")

__all__ = ["Engine", "EngineConfig", "RequestOutput", "CompletionOutput", "FirstToken"]

# Usage records kept in memory (the latest ones, for tests and tools; the usage log has them all): a long-running
# worker must not grow a list forever.
USAGE_RECORDS_KEPT = 1024


def auto_dtype(checkpoint_dtype: torch.dtype, device: str) -> torch.dtype:
    """`dtype=auto`: what is fastest on this device for this checkpoint (cpu_isa.choose_dtype)."""
    return choose_dtype(detected_level() if device.startswith("cpu") else "", checkpoint_dtype, device)


class Engine:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, model: LlamaModel, tokenizer: Tokenizer,
                 fingerprint: str):
        config.validate()
        self.model_config = model_config
        self.config = config
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.max_model_len = min(config.max_model_len or model_config.max_model_len, model_config.max_model_len)
        dtype = next(model.parameters()).dtype
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)  # the compute dtype unless quantized
        # With tensor parallelism (model.comm) each rank's pool holds its KV heads for the same block ids: the
        # sizes below are one rank's; every rank sizes its own pool the same way (on CUDA the profiling forward
        # runs on all ranks at once: it has collectives) and all take the smallest count.
        per_block = block_bytes_for(model_config.num_layers, config.block_size, model.shard.num_kv_heads,
                                    model_config.head_dim, kv_dtype)
        num_blocks = kv_pool_blocks(config, model, torch.device(config.device), per_block)
        if model.comm is not None:
            num_blocks = model.comm.min_int(num_blocks)
        # preemption by swap: the host pool, sized like the device pool per rank (every rank holds the same blocks)
        num_cpu_blocks = swap_blocks(config, per_block)
        self.kv_cache = (KVCache if model.comm is None else RecordingKVCache)(
            model_config, num_blocks, config.block_size, kv_dtype, config.device, num_cpu_blocks, fingerprint,
            num_kv_heads=model.shard.num_kv_heads, shard=model.shard, kv_cache_dtype=config.kv_cache_dtype)
        self.tp_group = None  # engine/tp/group.py: the other ranks' processes (set by from_pretrained)
        self.block_manager = BlockManager(num_blocks, config.block_size, fingerprint, config.enable_prefix_caching,
                                          num_cpu_blocks, kv=self.kv_cache)
        # Every layer windowed (sliding_window is the model-wide one; gpt-oss's full layers leave it None): a
        # sequence's blocks before its window are released as it moves on (block_manager.release_out_of_window).
        self.block_manager.window = model_config.sliding_window
        self.scheduler = Scheduler(config, self.block_manager)
        self.kv_offload = None
        if config.kv_offload_bytes:  # the host (and disk) KV tier: hooks in the block manager and scheduler
            self.kv_offload = KVOffload(self.block_manager, self.kv_cache, config.kv_offload_bytes,
                                        config.kv_offload_dir, config.kv_offload_disk_bytes)
            self.block_manager.offload = self.scheduler.recall = self.kv_offload
        self.core = EngineCore(self.scheduler, self.block_manager, self.max_model_len)  # shared with the simulator
        self.runner = ModelRunner(model, self.kv_cache, native=config.native_kernels, attention=config.attention,
                                  cuda_graph_max_batch=config.max_num_seqs if config.cuda_graphs else 0,
                                  deterministic=config.deterministic)
        model.reset_expert_tokens()  # the pool sizing's profiling forward routed no request's tokens
        self.sampler = Sampler(model_config.vocab_size, row_by_row=config.deterministic)
        self.sampler.native_ops = self.runner.native_ops
        self.info = EngineInfo(
            isa=detected_level() if self.runner.device.type == "cpu" else self.runner.device.type,
            dtype=str(dtype).removeprefix("torch."), kernels=self.runner.kernels_name(),
            checkpoint_dtype=str(model_config.checkpoint_dtype).removeprefix("torch."),
            chosen_by="auto" if config.dtype == "auto" else "--dtype",
            weights=weights_label(model.weight_storage, dtype),
            linear=("onednn+gemv" if model.gemv_bytes else "onednn") if model.packed else "torch")
        log.info("%s", self.info.line())
        self.eos_token_ids = sorted(set(model_config.eos_token_ids) | set(tokenizer.eos_token_ids))
        self.requests: dict[str, Request] = {}
        self.remote_pending: dict[str, Request] = {}
        self.usage_records: deque[UsageRecord] = deque(maxlen=USAGE_RECORDS_KEPT)
        self.terminal_counts: dict[str, int] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.batch_sizes: deque[tuple[int, int]] = deque(maxlen=4096)  # (sequences, tokens) of recent ticks
        self.spec = make_spec_decoder(self)  # speculative decoding, or None

    @classmethod
    def from_pretrained(cls, model: str | Path, config: EngineConfig | None = None) -> "Engine":
        config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_dir = resolve_model_dir(model)
        mcfg = ModelConfig.from_dir(model_dir)
        tokenizer = Tokenizer(model_dir, mcfg.eos_token_ids)
        tensors, digest = load_state_dict(model_dir)
        dtype = auto_dtype(mcfg.checkpoint_dtype, config.device) if config.dtype == "auto" else DTYPES[config.dtype]
        torch.manual_seed(config.seed)
        config.validate()
        # spec D08: refused before any rank starts
        shard = shard_for(mcfg, 0, config.ranks, config.expert_parallel_size > 1, config.replicated_attention)
        group = None
        if config.ranks > 1:
            from pdserve.engine.tp.group import RankGroup
            group = RankGroup.start(model_dir, config, dtype)
        with torch.device(config.device):
            net = LlamaModel(mcfg, shard, group.comm if group else None,
                             uses_all_to_all(config.expert_dispatch, config.expert_parallel_size, mcfg.num_experts_per_tok,
                                             config.replicated_attention)).to(dtype)
        net.load_hf_weights(tensors)
        del tensors
        net.eval()
        ops = native_ops() if config.native_kernels and config.device.startswith("cpu") else None
        storage = config.quantization if config.quantization != "none" else "same"
        reserve = config.kv_cache_bytes or CPU_DEFAULT_KV_BYTES
        if storage == "same" and config.dtype == "auto" and config.ranks == 1:
            # a bf16 checkpoint computed in fp32: bf16 copies for the decode GEMVs (quant.py, docs/engine.md)
            storage = auto_weight_storage(net, detected_level(), mcfg.checkpoint_dtype, dtype, config.device,
                                          ops is not None, reserve)
        if storage != "same":
            net.store_weights(storage, ops)
        if ops is not None and config.device.startswith("cpu"):
            net.stack_experts()  # sparse layers' experts for the native MoE kernel (moe.py)
        # bf16 computed as bf16: batch-1 decode through the native GEMV beside oneDNN's packed weights (quant.py)
        net.pack_weights(storage == "same" and config.ranks == 1 and keep_batch1_gemv(
            net, detected_level(), dtype, config.device, ops is not None, reserve))
        # int8 weights compute different KV: never shared with (or prefix-hit by) an unquantized deployment's.
        quant = "" if config.quantization == "none" else ":" + config.quantization
        # so does a quantized KV pool (other bytes for the same tokens): its own prefix-cache and disk-tier keys
        quant += "" if config.kv_cache_dtype == "auto" else ":kv-" + config.kv_cache_dtype
        engine = cls(mcfg, config, net, tokenizer, mcfg.fingerprint(digest + quant, dtype))
        engine.tp_group = group
        return engine

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent; a one-process engine holds nothing)."""
        if self.tp_group is not None:
            self.tp_group.stop()

    # ---- admission --------------------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (bad parameters) or RequestRejected (can never be served) before anything is held."""
        params.validate(self.model_config.vocab_size)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("invalid prompt: it tokenizes to zero tokens")
        if any(not (0 <= t < self.model_config.vocab_size) for t in prompt_token_ids):
            raise ValueError("invalid prompt: token id outside the vocabulary")
        if n >= self.max_model_len:
            raise RequestRejected(
                f"prompt has {n} tokens; this model's context is {self.max_model_len} tokens including output")
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            raise RequestRejected(f"prompt has {n} tokens, more than max_num_batched_tokens "
                                  f"{self.config.max_num_batched_tokens} with chunked prefill off")
        if self.block_manager.blocks_needed(n + 1) > self.block_manager.num_blocks:
            raise RequestRejected(f"prompt of {n} tokens needs more KV blocks than this worker has")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    namespace: str = "", prefill_only: bool = False, arrival_time: float | None = None,
                    deadline: float | None = None, priority: int = 0,
                    predicted_output_tokens: int | None = None, resume_token_ids: list[int] | None = None,
                    grammar: CompiledGrammar | None = None) -> None:
        """`deadline` (unix time): TIMED_OUT when passed; `priority` (lower = more urgent) and
        `predicted_output_tokens` feed the `priority` / `shortest-predicted-first` policies. `resume_token_ids`:
        a migrated request continues after these output tokens (engine/resume.py; one branch, not prefill-only).
        `grammar`: `params.guided` compiled off this thread (grammar_pool.py); None compiles it here."""
        if request_id in self.requests or request_id in self.remote_pending:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validate_request(prompt_token_ids, params)
        if resume_token_ids:
            resume.check(params, prefill_only)
        req = self._new_request(request_id, prompt_token_ids, params, namespace, arrival_time, grammar)
        req.prefill_only = prefill_only
        if resume_token_ids:
            predicted_output_tokens = resume.resume(req.seqs[0], resume_token_ids, self.model_config.vocab_size,
                                                    self.max_model_len, predicted_output_tokens)
            self.validate_request(req.seqs[0].token_ids, params)  # prompt + output must fit as a prefill does
        if params.beam:
            if prefill_only:
                raise InvalidParameter("beam_width", "beam search runs where the whole request runs (a colocated "
                                       "worker), not split into prefill and decode")
            req.beam = beams.start(params, len(req.prompt_token_ids), self.max_model_len, self.eos_token_ids,
                                   req.seqs[0])
        self._lifecycle(req, deadline, priority, predicted_output_tokens)
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])

    def _lifecycle(self, req: Request, deadline: float | None, priority: int, predicted: int | None) -> None:
        req.deadline = deadline
        seq = req.seqs[0]
        seq.priority = int(priority)
        if predicted is None:
            mt = req.params.max_tokens
            predicted = mt if mt is not None else self.max_model_len - len(req.prompt_token_ids)
        seq.predicted_output_tokens = int(predicted)

    def _new_request(self, request_id, prompt_token_ids, params, namespace, arrival_time,
                     compiled: CompiledGrammar | None = None) -> Request:
        arrival = arrival_time if arrival_time is not None else time.time()
        seq = Sequence(next(self._seq_ids), request_id, prompt_token_ids, namespace, 0, arrival)
        grammar = make_grammar_state(params.guided, self.tokenizer, self.model_config.vocab_size, compiled) \
            if params.guided is not None else None
        seq.sampling = SamplingState(params, list(prompt_token_ids), self.model_config.vocab_size,
                                     self.eos_token_ids, grammar, 0,
                                     bad_words_ids=bad_words_to_ids(params.bad_words, self.tokenizer),
                                     device=self.runner.device)
        seq.output = OutputProcessor(params, self.tokenizer, self.eos_token_ids)
        seq.wants_prompt_logprobs = params.prompt_logprobs is not None
        seq.set_state(S.QUEUED)
        return Request(request_id, list(prompt_token_ids), params, namespace, [seq], RequestTimes(arrival, time.time()))

    # ---- the step ---------------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    def drain_outputs(self) -> list[RequestOutput]:
        """Outputs produced outside a step (aborts, a committed remote prefill's first token), without waiting
        for the next forward: the first token of a disaggregated request must not wait a decode step."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def step(self) -> list[RequestOutput]:
        """One scheduler step: schedule, one forward, sample (or verify, or beam-search) the rows that need a
        token, commit them; the outputs of every request it touched (and of those that ended meanwhile)."""
        self._expire(time.time())
        outputs = self.drain_outputs()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            beams.unstall([r.beam for r in self.requests.values() if r.beam is not None], self.scheduler)
            return outputs
        self._started(sched)
        want_prompt = {i for i, it in enumerate(sched.scheduled)
                       if it.seq.wants_prompt_logprobs and it.seq.num_output_tokens == 0}
        verifying = self.spec.begin(sched) if self.spec is not None else set()
        logits, owner = self.runner.execute(sched.scheduled, want_prompt | verifying)
        self.core.computed(sched)
        rows, seqs, spec_rows, beam_rows = self._rows(sched, owner, logits, want_prompt, verifying)
        # sampled where the logits are (the requests' generators live there too); the results cross in one copy
        sampled = logits
        if seqs and rows != list(range(logits.shape[0])):
            sampled = logits.index_select(0, to_device(rows, logits.device, torch.long))
        results = self.sampler.sample(sampled, [s.sampling for s in seqs]) if seqs else []
        if (spec_rows or beam_rows) and logits.device.type != "cpu":
            logits = logits.cpu()  # speculative verification and beam search choose their tokens on the host
        touched = self._commit(sched, seqs, results, spec_rows, beam_rows, logits)
        for req in touched.values():
            if req.finished:
                self._reclaim(req, S.FINISHED)
            outputs.append(self._output(req))
        return outputs

    def _started(self, sched) -> None:
        """Step statistics, and the first-scheduled time of the requests scheduled for the first time."""
        if self.config.fault_step_delay_s:  # fault injection: a slow device (docs/reliability.md)
            time.sleep(self.config.fault_step_delay_s)
        self.num_steps += 1
        self.batch_sizes.append((len(sched.scheduled), sched.num_batched_tokens))
        now = time.time()
        for item in sched.scheduled:
            req = self.requests[item.seq.request_id]
            if req.times.first_scheduled is None:
                req.times = req.times.scheduled_at(now)

    def _rows(self, sched, owner, logits, want_prompt: set[int], verifying: set[int]):
        """Which logits row does what: (rows to sample, their sequences, verifying item -> its k + 1 rows, beam
        request -> its (sequence, row)s). Prompt rows of a prompt-logprobs request are collected here. A request's
        first sample forks its extra branches, which share the prompt's blocks (and the row)."""
        rows, seqs = [], []
        spec_rows: dict[int, list[int]] = {}
        beam_rows: dict[str, list[tuple[Sequence, int]]] = {}  # beam search chooses its own tokens
        for row, (i, pos) in enumerate(owner):
            seq = sched.scheduled[i].seq
            if i in verifying:
                spec_rows.setdefault(i, []).append(row)
                continue
            if i in want_prompt and pos < seq.num_prompt_tokens - 1:
                self._collect_prompt_logits(seq, logits[row:row + 1])
                continue
            req = self.requests[seq.request_id]
            if req.beam is not None:
                beam_rows.setdefault(req.request_id, []).append((seq, row))
                continue
            rows.append(row)
            seqs.append(seq)
            if seq.branch == 0 and seq.num_output_tokens == 0 and len(req.seqs) < req.params.num_branches:
                for child in self._fork(req, seq, join=True):
                    rows.append(row)
                    seqs.append(child)
        return rows, seqs, spec_rows, beam_rows

    def _commit(self, sched, seqs, results, spec_rows, beam_rows, logits) -> dict[str, Request]:
        """Commit the sampled tokens, the speculative tokens verification accepted (rolling back the rest) and
        the beams' choices; returns the requests this touched."""
        touched: dict[str, Request] = {}
        now = time.time()
        for seq, res in zip(seqs, results):
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            req.times = req.times.first_token_at(now)
            if seq.sampling.params.logprobs is not None:
                seq.logprobs.append(res)
            self.core.commit(seq, res.token_id, req.prefill_only)
        for i, spec_row in spec_rows.items():
            seq = sched.scheduled[i].seq
            req = touched[seq.request_id] = self.requests[seq.request_id]
            verified = self.spec.finish(sched.scheduled[i], logits[spec_row], req.prefill_only)
            if seq.sampling.params.logprobs is not None:
                seq.logprobs.extend(verified)
        for rid, items in beam_rows.items():
            req = touched[rid] = self.requests[rid]
            req.times = req.times.first_token_at(now)
            live = beams.step(req.beam, [(seq, logits[row]) for seq, row in items], self.core,
                              lambda: next(self._seq_ids))
            if live:
                req.seqs = live
        return touched

    def _collect_prompt_logits(self, seq: Sequence, row: torch.Tensor) -> None:
        """Prompt logprobs need logits at every prompt position, gathered over the prefill chunks."""
        seq.prompt_logit_rows.append(row)
        if len(seq.prompt_logit_rows) == seq.num_prompt_tokens - 1:
            req = self.requests[seq.request_id]
            req.prompt_logprobs = self.sampler.prompt_logprobs(
                torch.cat(seq.prompt_logit_rows), req.prompt_token_ids, req.params.prompt_logprobs)
            seq.prompt_logit_rows = []

    def _fork(self, req: Request, parent: Sequence, join: bool) -> list[Sequence]:
        """The request's other branches, sharing `parent`'s blocks (before its first token: the prompt's)."""
        children = []
        for b in range(len(req.seqs), req.params.num_branches):
            child = Sequence(next(self._seq_ids), req.request_id, parent.token_ids, req.namespace, b,
                             parent.arrival_time)
            child.sampling = parent.sampling.fork(b)  # own RNG stream, forked grammar matcher
            child.output = OutputProcessor(req.params, self.tokenizer, self.eos_token_ids)
            if join:
                self.core.fork(parent, child)
            req.seqs.append(child)
            children.append(child)
        return children

    def _output(self, req: Request) -> RequestOutput:
        if req.beam is not None:
            return beams.output(req, self.tokenizer)
        # best_of > n: nothing was shown while it ran, so the chosen branches' "new" output is all of it
        whole = req.hides_branches()
        live = req.chosen() if whole else req.seqs
        outs = []
        for i, seq in enumerate(live):
            text = seq.output.text if hasattr(seq.output, "text") else seq.text
            done = seq.finished or whole  # running: cumulative ids and logprobs as prefixes, not copies (outputs.py)
            ids = seq.output_token_ids if done else Prefix(seq.token_ids, seq.num_prompt_tokens, seq.num_tokens)
            lps = None
            if seq.sampling.params.logprobs is not None:
                lps = list(seq.logprobs) if done else Prefix(seq.logprobs, 0, len(seq.logprobs))
            outs.append(CompletionOutput(
                index=i, text=text, token_ids=ids, new_text=text if whole else seq.new_text,
                new_token_ids=list(ids) if whole else seq.new_token_ids, finish_reason=seq.finish_reason,
                cumulative_logprob=seq.sampling.cumulative_logprob, logprobs=lps))
        seqs = req.seqs
        for seq in seqs:
            seq.new_text, seq.new_token_ids = "", []
        finished = req.finished
        counts = req.token_counts()
        return RequestOutput(req.request_id, req.prompt_token_ids, outs, finished,
                             seqs[0].state.value if not finished else req.terminal_state().value,
                             seqs[0].num_cached_tokens, req.times, req.prompt_logprobs,
                             num_generated_tokens=counts[0], num_verified_tokens=counts[1],
                             num_accepted_tokens=counts[2], num_kv_growth_tokens=counts[3])

    # ---- deadlines and backpressure ----------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        """Deadlines: any live request past its deadline ends TIMED_OUT (queued, preempted, swapped, running or
        backpressured alike: the client has stopped waiting). Requests whose KV is being pulled (remote_pending)
        are left to their transfer deadline (`expire_transfers`): their blocks may still be written by NIXL. Also:
        a request backpressured for longer than `backpressure_preempt_s` gives its KV back (preempted, §1.4)."""
        self.expire_transfers(now)
        for req in list(self.requests.values()):
            if req.deadline is not None and now >= req.deadline and not req.reclaimed:
                self.abort(req.request_id, "TIMED_OUT")
            elif req.paused_since is not None and now - req.paused_since > self.config.backpressure_preempt_s:
                for seq in req.seqs:
                    if seq.state == S.BACKPRESSURED:
                        self.scheduler.preempt(seq)

    def expire_transfers(self, now: float) -> None:
        """A remote prefill whose KV never arrived (the decode side neither committed nor failed it by its
        transfer deadline) ends FAILED and frees its blocks: nothing else would ever free them. The deadline lies
        past the decode service's own READ timeout, so a READ still writing into them has given up by then."""
        for req in list(self.remote_pending.values()):
            if req.transfer_deadline is not None and now >= req.transfer_deadline:
                log.warning("request %s: KV transfer never completed; freeing its blocks", req.request_id)
                self.abort(req.request_id, "FAILED")

    def set_paused(self, request_id: str, paused: bool) -> bool:
        """Backpressure on/off for a request (its consumer's buffer is full / drained). Returns whether it
        exists. Paused sequences keep their KV but get no ticks; running ones show BACKPRESSURED."""
        req = self.requests.get(request_id)
        if req is None or req.reclaimed or (req.paused_since is not None) == paused:
            return req is not None
        req.paused_since = time.time() if paused else None
        for seq in req.seqs:
            if seq.finished:
                continue
            seq.paused = paused
            if paused and seq.state == S.DECODING:
                seq.set_state(S.BACKPRESSURED)
            elif not paused and seq.state == S.BACKPRESSURED:
                seq.set_state(S.DECODING)
        return True

    def state_counts(self) -> dict[str, int]:
        """Live sequences per state (the per-state gauges)."""
        counts: dict[str, int] = {}
        for req in list(self.requests.values()) + list(self.remote_pending.values()):
            for seq in req.seqs:
                if seq.state is not None and not seq.finished:
                    counts[seq.state.value] = counts.get(seq.state.value, 0) + 1
        return counts

    # ---- termination: one idempotent reclaim ------------------------------------------------------------------
    def _reclaim(self, req: Request, state: S) -> None:
        if req.reclaimed:
            return
        for seq in req.seqs:
            self.core.finish(seq, state, req.prefill_only)
        req.reclaimed = True
        self.requests.pop(req.request_id, None)
        self.remote_pending.pop(req.request_id, None)
        final = req.terminal_state()
        req.state = final
        req.times = req.times.finished_at(time.time())
        self.terminal_counts[final.value] = self.terminal_counts.get(final.value, 0) + 1
        record = req.usage_record()
        self.usage_records.append(record)
        if usage_log.isEnabledFor(logging.INFO):
            usage_log.info(json.dumps(asdict(record)))

    def abort(self, request_id: str, state: str = "CANCELLED") -> None:
        """Cancel, time out or fail a request now; a no-op for unknown or already finished requests."""
        target = S[state]
        if target not in (S.CANCELLED, S.TIMED_OUT, S.FAILED):
            raise ValueError(f"abort state must be CANCELLED, TIMED_OUT or FAILED, not {state}")
        req = self.requests.get(request_id) or self.remote_pending.get(request_id)
        if req is None or req.reclaimed:
            return
        for seq in req.seqs:
            if not seq.finished and seq.finish_reason is None:
                seq.finish_reason = "timeout" if target == S.TIMED_OUT else "abort"
        self._reclaim(req, target)
        self._pending_outputs.append(self._output(req))

    # ---- disaggregation hooks ---------------------------------------------------------------------------------
    def pinned_kv(self, request_id: str) -> tuple[list[int], int]:
        return self.core.pinned_kv(request_id)

    def release_pinned(self, request_id: str) -> None:
        self.core.release_pinned(request_id)

    def discard(self, request_id: str) -> None:
        """Prefill side, the caller is gone: end the request CANCELLED wherever it is (still prefilling: aborted;
        prefilled, its KV pinned but handed to nobody: released). Idempotent; unknown ids are a no-op."""
        self.abort(request_id, "CANCELLED")
        self.release_pinned(request_id)

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], first_tokens: list[FirstToken],
                              params: SamplingParams, *, namespace: str = "",
                              arrival_time: float | None = None, deadline: float | None = None,
                              priority: int = 0, transfer_deadline: float | None = None,
                              grammar: CompiledGrammar | None = None) -> tuple[list[int], int] | None:
        """Decode side: allocate blocks for a prompt prefilled elsewhere, once for all branches. `first_tokens`:
        each branch's first token (branch i = entry i; n, or best_of of them), sampled by the prefill worker.
        Returns (block ids, number of leading blocks already valid from the local prefix cache) or None when the
        blocks cannot be had now.
        `transfer_deadline` (unix time): not committed by then, the request ends FAILED (`expire_transfers`)."""
        if request_id in self.requests or request_id in self.remote_pending:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.validate_request(prompt_token_ids, params)
        if params.beam:
            raise InvalidParameter("beam_width", "beam search runs on a colocated worker, not from a remote prefill")
        if len(first_tokens) != params.num_branches:
            raise ValueError(f"invalid first tokens: {len(first_tokens)} for {params.num_branches} branches")
        if any(not (0 <= f.token_id < self.model_config.vocab_size) for f in first_tokens):
            raise ValueError("invalid first tokens: token id outside the vocabulary")
        req = self._new_request(request_id, prompt_token_ids, params, namespace, arrival_time, grammar)
        self._lifecycle(req, deadline, priority, None)
        seq = req.seqs[0]
        hits = self.core.allocate_prefilled(seq, reuse=not self.config.no_decode_prefix_reuse)
        if hits is None:
            return None
        req.first_tokens = list(first_tokens)
        req.transfer_deadline = transfer_deadline
        self.remote_pending[request_id] = req
        return list(seq.block_table), hits

    def commit_prefilled(self, request_id: str) -> bool:
        """The transferred blocks hold the prompt's KV: the branches fork from it (sharing its blocks), each
        appends its own first token and joins the decode batch.
        False when the request is no longer pending (its transfer deadline passed, or it was aborted)."""
        req = self.remote_pending.pop(request_id, None)
        if req is None:
            return False
        self._fork(req, req.seqs[0], join=False)
        for seq, first in zip(req.seqs, req.first_tokens, strict=True):
            Sampler.skip_draw(seq.sampling)  # the first token was drawn on the prefill worker
            seq.sampling.append(first.token_id)
            seq.sampling.cumulative_logprob = first.cumulative_logprob
            if seq.sampling.params.logprobs is not None and first.logprobs is not None:
                seq.logprobs.append(first.logprobs)
        req.times = req.times.first_token_at(time.time())
        self.requests[request_id] = req
        reasons = self.core.commit_prefilled(req.seqs, [f.token_id for f in req.first_tokens])
        if all(r is not None for r in reasons):
            self._reclaim(req, S.FINISHED)
        self._pending_outputs.append(self._output(req))
        return True

    def fail_prefilled(self, request_id: str) -> None:
        self.abort(request_id, "FAILED")

    def has_pending_transfers(self) -> bool:
        return bool(self.remote_pending)

    def drain_kv_events(self) -> list:
        """Block stored/evicted events since the last call (for the router's prefix index)."""
        events = list(self.block_manager.events)
        self.block_manager.events.clear()
        return events

    # ---- convenience ------------------------------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams],
                 namespace: str = "") -> list[RequestOutput]:
        """Run a batch to completion and return the final output of each prompt, in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            toks = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"gen-{id(prompts)}-{i}"
            self.add_request(rid, toks, p, namespace=namespace)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]

    def queued_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens of waiting sequences that prefill will actually compute: each one's
        current prefix-cache hit is subtracted, so a queued request whose prefix is cached counts only its
        uncached tail (the router's queued-work estimate, docs/routing.md). `lookup` is a pure read; a hit can
        still be evicted before the sequence is scheduled, so this is an estimate of the moment."""
        bs = self.block_manager.block_size
        n = 0
        for seq in list(self.scheduler.waiting):
            hit = len(self.block_manager.lookup(seq)) * bs
            n += max(0, seq.num_tokens - max(hit, seq.num_computed_tokens))
        return n

    def pending_prefill_tokens(self) -> int:
        """Prefill work queued ahead of a new request: the waiting queue's uncached tokens
        (`queued_prefill_tokens`) + what running sequences still have to prefill (chunked prefill in progress)."""
        n = self.queued_prefill_tokens()
        for s in list(self.scheduler.running):
            n += max(0, s.num_prompt_tokens - s.num_computed_tokens)
        return n

    def has_waiting(self) -> bool:
        """Any sequence queued for its (first or re-)prefill."""
        return bool(self.scheduler.waiting)

    def set_tenant_share(self, namespace: str, fraction: float) -> None:
        """The namespace's guaranteed fraction of the KV blocks for fair eviction (engine/kv_fairness.py); 0 lifts
        it. In force for every allocation after this call."""
        self.block_manager.set_share(namespace, fraction)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        logical = sum(s.num_computed_tokens for r in self.requests.values() for s in r.seqs if not s.finished)
        return EngineStats(
            kv_blocks_in_use=bm.blocks_in_use, kv_blocks_total=bm.num_blocks, kv_blocks_cached_free=len(bm.evictable),
            kv_blocks_pinned=self.core.num_pinned_blocks(), kv_logical_slots=logical,
            kv_allocated_slots=bm.blocks_in_use * bm.block_size, cpu_blocks_in_use=bm.num_cpu_blocks - len(bm.cpu_free),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped), states=MappingProxyType(self.state_counts()),
            prefix_hit_ratio=bm.hit_ratio, prefix_queried_tokens=bm.queried_tokens, prefix_hit_tokens=bm.hit_tokens,
            preemptions=MappingProxyType(dict(self.scheduler.num_preemptions)),
            terminal=MappingProxyType(dict(self.terminal_counts)),
            tier=self.kv_offload.stats() if self.kv_offload is not None else None,
            spec=self.spec.stats.snapshot() if self.spec is not None else None,
            expert_tokens=self.runner.model.expert_tokens())
