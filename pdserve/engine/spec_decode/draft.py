"""Draft-model proposer: a smaller checkpoint with the same tokenizer, run by its own ModelRunner over its own
paged KV pool (no prefix caching: its blocks are private scratch).

Each target sequence has a shadow sequence in the draft's pool. Per proposal the shadow first keeps only the KV
of tokens still in the target sequence (the candidates the target rejected are rolled back here too), then the
draft forwards what it has not seen (the tokens committed since, or the whole context on a decode worker that
received the prompt's KV from a prefill worker) and k - 1 more single tokens, batched over the sequences.
At T = 0 the draft proposes its argmax (a point mass: verification is greedy equality); at T > 0 it draws
d_j ~ q_j, q_j = its logits through the request's temperature and truncation filters (no penalties), and
returns q_j for the min(1, p/q) test. The draft draws with its own generator (seeded from the request's seed),
so the request's own stream is consumed by the target's verification draws only.
"""
from __future__ import annotations

import hashlib
import os

import torch

from pdserve.engine.block_manager import BlockManager, NoFreeBlocks
from pdserve.engine.checkpoint import resolve_model_dir
from pdserve.engine.config import ModelConfig
from pdserve.engine.errors import CheckpointError
from pdserve.engine.kv_cache import KVCache
from pdserve.engine.loader import load_state_dict
from pdserve.engine.model import LlamaModel
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.verify import filtered_probs
from pdserve.engine.tokenizer import Tokenizer


def draft_seed(seed: int) -> int:
    return int.from_bytes(hashlib.blake2b(b"draft:%d" % seed, digest_size=8).digest(), "little")


class _Shadow:
    def __init__(self, seq: Sequence, seed: int | None):
        self.seq = Sequence(seq.seq_id, seq.request_id, [], seq.namespace, seq.branch)
        self.base = 0  # len(target tokens) at the last proposal: those tokens are committed, never change
        self.generator = torch.Generator()
        # Never the request's own stream: a draw of d_j and the uniform of its acceptance test must be independent
        # (equal streams bias the accepted tokens). Hashed, as the CPU generator keeps only the seed's low 32 bits.
        self.generator.manual_seed(draft_seed(seed) if seed is not None else int.from_bytes(os.urandom(8), "little"))


class DraftProposer:
    def __init__(self, model_dir: str, target_cfg: ModelConfig, target_tokenizer: Tokenizer, config,
                 dtype: torch.dtype, num_blocks: int, filter_order: tuple[str, ...]):
        path = resolve_model_dir(model_dir)
        cfg = ModelConfig.from_dir(path)
        if cfg.vocab_size != target_cfg.vocab_size or \
                Tokenizer(path, cfg.eos_token_ids).hf.get_vocab() != target_tokenizer.hf.get_vocab():
            raise CheckpointError(f"draft model {model_dir}: its tokenizer / vocabulary differs from the target's "
                                  "(speculative decoding needs the same token ids)")
        tensors, digest = load_state_dict(path)
        with torch.device(config.device):
            net = LlamaModel(cfg).to(dtype)
        net.load_hf_weights(tensors)
        net.eval()
        net.pack_weights()
        self.cfg = cfg
        self.kv = KVCache(cfg, num_blocks, config.block_size, dtype, config.device, 0, "draft:" + digest)
        self.bm = BlockManager(num_blocks, config.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(net, self.kv, native=config.native_kernels, attention=config.attention)
        self.filter_order = filter_order
        self.shadows: dict[int, _Shadow] = {}

    def forget(self, live_seq_ids: set[int]) -> None:
        for sid in [s for s in self.shadows if s not in live_seq_ids]:
            self.bm.free(self.shadows.pop(sid).seq)

    def _sync(self, seq: Sequence) -> _Shadow:
        """The shadow's KV keeps the positions whose tokens still stand in `seq` (rolls rejected ones back)."""
        sh = self.shadows.get(seq.seq_id)
        if sh is None:
            sh = self.shadows[seq.seq_id] = _Shadow(seq, seq.sampling.params.seed)
        s, new = sh.seq, seq.token_ids
        i = min(s.num_computed_tokens, sh.base)
        while i < s.num_computed_tokens and i < len(new) - 1 and s.token_ids[i] == new[i]:
            i += 1
        s.num_computed_tokens = i
        keep = self.bm.blocks_needed(i)
        for b in reversed(s.block_table[keep:]):
            self.bm.release_block(b)
        del s.block_table[keep:]
        s.token_ids = list(new)
        sh.base = len(new)
        return sh

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[tuple[list[int], list | None]]:
        shadows = [self._sync(seq) for seq in seqs]
        ks = [min(k, self.cfg.max_model_len - seq.num_tokens - 1) for seq, k in zip(seqs, ks)]  # draft's positions
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list | None] = [[] if seq.sampling.params.temperature > 0 else None for seq in seqs]
        live = [i for i, k in enumerate(ks) if k > 0]
        for _ in range(max(ks, default=0)):
            batch, idx = [], []
            for i in live:
                s = shadows[i].seq
                n = s.num_tokens - s.num_computed_tokens
                try:
                    self.bm.allocate(s, n)
                except NoFreeBlocks:  # the draft's pool is full: fewer candidates for this one, nobody waits
                    continue
                batch.append(ScheduledSeq(s, n))
                idx.append(i)
            if not batch:
                break
            logits, _ = self.runner.execute(batch)
            logits = logits.float().cpu()
            for row, (i, item) in enumerate(zip(idx, batch)):
                item.seq.num_computed_tokens += item.num_tokens
                params = seqs[i].sampling.params
                if qs[i] is None:
                    tok = int(logits[row].argmax())
                else:
                    q = filtered_probs(logits[row], params, self.filter_order)
                    cdf = q.cumsum(-1)
                    u = torch.rand((), generator=shadows[i].generator, dtype=torch.float64)
                    tok = int(torch.searchsorted(cdf, (u * cdf[-1]).unsqueeze(0), right=True).clamp_(max=len(q) - 1))
                    qs[i].append(q)
                drafts[i].append(tok)
                item.seq.token_ids.append(tok)
            live = [i for i in idx if len(drafts[i]) < ks[i]]
            if not live:
                break
        return list(zip(drafts, qs))
