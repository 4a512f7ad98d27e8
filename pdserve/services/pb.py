"""One import point for the generated stubs plus conversions between them and engine dataclasses."""
from __future__ import annotations

import dataclasses

from pdserve._proto.pdserve.v1 import common_pb2, gateway_pb2_grpc, router_pb2, router_pb2_grpc  # noqa: F401
from pdserve._proto.pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: F401
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams

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
