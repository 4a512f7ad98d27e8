"""Engine RequestOutput -> GenerateResponse deltas."""
from __future__ import annotations

from pdserve.engine.outputs import FirstToken, RequestOutput
from pdserve.engine.sampler import SampleResult
from pdserve.services.pb import common_pb2


class DeltaEncoder:
    """Turns successive RequestOutputs of one request into wire deltas (logprobs are cumulative in the engine)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._lp_sent: dict[int, int] = {}
        self._prompt_lp_sent = False

    def _tok(self, tid: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def token_logprob(self, r) -> common_pb2.TokenLogprob:
        lp = common_pb2.TokenLogprob(token_id=r.token_id, token=self._tok(r.token_id),
                                     logprob=float(r.logprob if r.logprob is not None else 0.0))
        for tid, v in (r.top_logprobs or []):
            lp.top.add(token_id=tid, token=self._tok(tid), logprob=float(v))
        return lp

    def prompt_logprobs(self, msg: common_pb2.GenerateResponse, out: RequestOutput) -> None:
        """The engine's prompt logprobs (entry 0 is None: the first token has no prefix) into `msg`."""
        for r in (out.prompt_logprobs or [])[1:]:
            msg.prompt_logprobs.append(self.token_logprob(r))

    def encode(self, out: RequestOutput) -> common_pb2.GenerateResponse:
        msg = common_pb2.GenerateResponse(request_id=out.request_id, finished=out.finished, state=out.state or "")
        for c in out.outputs:
            d = msg.outputs.add(index=c.index, text=c.new_text or "", token_ids=list(c.new_token_ids or []),
                                finish_reason=c.finish_reason or "")
            if c.logprobs is not None:
                start = self._lp_sent.get(c.index, 0)
                for r in c.logprobs[start:]:
                    d.logprobs.append(self.token_logprob(r))
                self._lp_sent[c.index] = len(c.logprobs)
        if out.prompt_logprobs and not self._prompt_lp_sent:
            self._prompt_lp_sent = True
            self.prompt_logprobs(msg, out)
        if out.error:
            msg.error = out.error
        if out.finished:
            msg.usage.prompt_tokens = len(out.prompt_token_ids)
            msg.usage.completion_tokens = sum(len(c.token_ids) for c in out.outputs)
            msg.usage.cached_tokens = out.num_cached_tokens or 0
            msg.usage.generated_tokens = out.num_generated_tokens
        fill_times(msg.times, out.metrics)
        return msg


def first_tokens_from_pb(firsts) -> list[FirstToken]:
    """The prefill worker's `FirstToken`s (worker.proto) -> the engine's, one per branch."""
    out = []
    for f in firsts:
        lp = None
        if f.HasField("logprob"):
            lp = SampleResult(f.logprob.token_id, f.logprob.logprob, [(t.token_id, t.logprob) for t in f.logprob.top])
        out.append(FirstToken(f.token_id, f.cumulative_logprob, lp))
    return out


def fill_times(times: common_pb2.StageTimes, metrics: dict | None) -> None:
    """The engine's request timestamps (Unix seconds) -> StageTimes (0 = not reached)."""
    m = metrics or {}
    times.arrival = m.get("arrival_time", 0.0) or 0.0
    times.first_scheduled = m.get("first_scheduled_time", 0.0) or 0.0
    times.first_token = m.get("first_token_time", 0.0) or 0.0
    times.finished = m.get("finished_time", 0.0) or 0.0


def full_response(out: RequestOutput, tokenizer=None) -> common_pb2.GenerateResponse:
    """The whole result as one message (cumulative text/tokens): prefill that already finished the request."""
    from dataclasses import replace
    cum = replace(out, outputs=[replace(c, new_text=c.text, new_token_ids=list(c.token_ids)) for c in out.outputs])
    return DeltaEncoder(tokenizer).encode(cum)
