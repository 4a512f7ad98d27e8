"""The one place where Python-side values become wire messages and back: engine outputs -> GenerateResponse
deltas, SamplingParams and KV layouts, request lifecycle limits, KV regions. (Worker records <-> WorkerInfo +
LoadReport live with the record, in registry.py.)
Everything between processes is a proto message; nothing here builds a string-keyed dict for the wire."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.engine.outputs import FirstToken, RequestOutput, RequestTimes, SampleResult
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams
from pdserve.kv_transfer.layout import KVLayout, KVRegion
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
            msg.usage.verified_tokens = out.num_verified_tokens
            msg.usage.accepted_tokens = out.num_accepted_tokens
            msg.usage.kv_growth_tokens = out.num_kv_growth_tokens
        fill_times(msg.times, out.times)
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


def fill_times(times: common_pb2.StageTimes, t: RequestTimes | None) -> None:
    """The engine's request timestamps (Unix seconds) -> StageTimes (0 = not reached)."""
    if t is None:
        return
    times.arrival = t.arrival
    times.first_scheduled = t.first_scheduled or 0.0
    times.first_token = t.first_token or 0.0
    times.finished = t.finished or 0.0


def full_response(out: RequestOutput, tokenizer=None) -> common_pb2.GenerateResponse:
    """The whole result as one message (cumulative text/tokens): prefill that already finished the request."""
    from dataclasses import replace
    cum = replace(out, outputs=[replace(c, new_text=c.text, new_token_ids=list(c.token_ids)) for c in out.outputs])
    return DeltaEncoder(tokenizer).encode(cum)


# ---- request lifecycle (gateway -> workers) -------------------------------------------------------------------
def lifecycle_to_pb(deadline: float | None, priority: int | None, predicted: int | None,
                    kv_share: float | None = None) -> common_pb2.Lifecycle:
    m = common_pb2.Lifecycle()
    if kv_share is not None:
        m.kv_share = float(kv_share)
    if deadline is not None:
        m.deadline_unix = deadline
    if priority is not None:
        m.priority = int(priority)
    if predicted is not None:
        m.predicted_output_tokens = int(predicted)
    return m


@dataclass(frozen=True)
class RequestLimits:
    """A Lifecycle as the engine takes it (None / 0: the engine's defaults)."""

    deadline: float | None = None
    priority: int = 0
    predicted_output_tokens: int | None = None
    kv_share: float | None = None  # the tenant's guaranteed KV fraction, for the namespace of the request

    def apply_share(self, host, namespace: str) -> None:
        """Record the tenant's share for fair eviction (engine/kv_fairness.py) before the request is added:
        engine commands run in order, so it is in force when the request first allocates."""
        if self.kv_share is not None:
            share = self.kv_share
            host.submit(lambda e: e.set_tenant_share(namespace, share))


def limits_from_pb(m: common_pb2.Lifecycle) -> RequestLimits:
    return RequestLimits(m.deadline_unix if m.HasField("deadline_unix") else None,
                  m.priority if m.HasField("priority") else 0,
                  m.predicted_output_tokens if m.HasField("predicted_output_tokens") else None,
                  m.kv_share if m.HasField("kv_share") else None)


# ---- KV regions (the KV handshake) ----------------------------------------------------------------------------
def region_to_pb(r: KVRegion) -> common_pb2.KvRegion:
    return common_pb2.KvRegion(agent_name=r.agent_name, agent_metadata=r.agent_metadata, base_addr=r.base_addr,
                               num_blocks=r.num_blocks, device_id=r.device_id, mem_type=r.mem_type,
                               layout=layout_to_pb(r.layout.to_dict()))


def region_from_pb(r: common_pb2.KvRegion) -> KVRegion:
    return KVRegion(r.agent_name, r.agent_metadata, r.base_addr, r.num_blocks, r.device_id, r.mem_type,
                    KVLayout.from_dict(layout_from_pb(r.layout)))


# ---- sampling parameters and KV layouts -----------------------------------------------------------------------
# Fields whose proto type is a plain repeated/map (no presence): copied as lists/dicts.
_LISTS = {"stop", "stop_token_ids", "bad_words"}


def params_to_pb(p: SamplingParams) -> common_pb2.SamplingParams:
    m = common_pb2.SamplingParams()
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if f.name == "guided":
            if v is not None:
                g = m.guided
                g.json_object = v.json_object
                for k in ("json_schema", "regex", "grammar"):
                    if getattr(v, k) is not None:
                        setattr(g, k, getattr(v, k))
        elif f.name == "early_stopping":
            m.early_stopping = v if isinstance(v, str) else ("true" if v else "false")
        elif f.name == "logit_bias":
            for k, b in v.items():
                m.logit_bias[int(k)] = float(b)
        elif f.name == "allowed_token_ids":
            if v is not None:
                m.has_allowed_token_ids = True
                m.allowed_token_ids.extend(v)
        elif f.name in _LISTS:
            getattr(m, f.name).extend(v)
        elif v is not None:
            setattr(m, f.name, v)
    return m


def params_from_pb(m: common_pb2.SamplingParams) -> SamplingParams:
    kw: dict = {}
    for f in dataclasses.fields(SamplingParams):
        n = f.name
        if n == "guided":
            if m.HasField("guided"):
                g = m.guided
                kw[n] = GuidedSpec(
                    json_schema=g.json_schema if g.HasField("json_schema") else None,
                    json_object=g.json_object,
                    regex=g.regex if g.HasField("regex") else None,
                    grammar=g.grammar if g.HasField("grammar") else None,
                )
        elif n == "early_stopping":
            if m.HasField(n):  # an unknown word stays a string: validate() names it
                kw[n] = {"true": True, "false": False}.get(m.early_stopping, m.early_stopping)
        elif n == "logit_bias":
            kw[n] = {int(k): float(v) for k, v in m.logit_bias.items()}
        elif n == "allowed_token_ids":
            kw[n] = list(m.allowed_token_ids) if m.has_allowed_token_ids else None
        elif n in _LISTS:
            kw[n] = list(getattr(m, n))
        elif m.HasField(n):
            kw[n] = getattr(m, n)
        elif n == "max_tokens":
            kw[n] = None  # absent on the wire means "up to the context limit", not the dataclass default 16
    return SamplingParams(**kw)


def layout_to_pb(d: dict) -> common_pb2.KvLayout:
    return common_pb2.KvLayout(**{k: d[k] for k in common_pb2.KvLayout.DESCRIPTOR.fields_by_name if k in d})


def layout_from_pb(m: common_pb2.KvLayout) -> dict:
    return {f.name: getattr(m, f.name) for f in m.DESCRIPTOR.fields}
