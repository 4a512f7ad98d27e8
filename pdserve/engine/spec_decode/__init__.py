"""Speculative decoding (spec §5.1 step 3, §7, Q16): proposers (ngram.py, draft.py), exact verification
(verify.py) and the engine-side propose / verify / roll back (decoder.py)."""
from __future__ import annotations

__all__ = ["make_spec_decoder"]


def make_spec_decoder(engine):
    """The engine's SpecDecoder for its config (`speculative`: None | ngram | draft), or None."""
    cfg = engine.config
    if not cfg.speculative:
        return None
    from pdserve.engine.spec_decode.decoder import SpecDecoder  # torch: not imported by the CLI's flag parsing
    if cfg.speculative == "ngram":
        from pdserve.engine.spec_decode.ngram import NgramProposer
        proposer = NgramProposer()
    else:
        from pdserve.engine.spec_decode.draft import DraftProposer
        proposer = DraftProposer(cfg.draft_model, engine.model_config, engine.tokenizer, cfg,
                                 engine.kv_cache.data.dtype, engine.block_manager.num_blocks,
                                 engine.sampler.filter_order)
    return SpecDecoder(proposer, cfg.num_speculative_tokens, engine.sampler, engine.core, engine.max_model_len)
