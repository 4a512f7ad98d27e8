"""The checked-in stubs are exactly what `python -m pdserve.proto_gen` produces, and conversions round-trip."""

from pdserve import proto_gen
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams
from pdserve.services import convert


def test_regenerated_stubs_identical(tmp_path):
    proto_gen.generate(tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_text() for p in tmp_path.rglob("*.py*")}
    checked = {p.relative_to(proto_gen.DEFAULT_OUT): p.read_text() for p in proto_gen.DEFAULT_OUT.rglob("*.py*")
               if "__pycache__" not in p.parts}
    assert fresh.keys() == checked.keys()
    for k in fresh:
        assert fresh[k] == checked[k], f"{k} differs: rerun python -m pdserve.proto_gen"


def test_sampling_params_roundtrip():
    cases = [
        SamplingParams(),
        SamplingParams(max_tokens=None, temperature=0.0, seed=7, stop=["a", "b"], logit_bias={3: -2.5},
                       allowed_token_ids=[], guided=GuidedSpec(json_schema='{"type":"object"}'), logprobs=0),
        SamplingParams(n=3, top_k=5, top_p=0.5, min_p=0.1, presence_penalty=1.0, frequency_penalty=-1.0),
        SamplingParams(beam_width=4, n=2, length_penalty=-0.5, early_stopping="never"),
        SamplingParams(beam_width=2, early_stopping=True), SamplingParams(beam_width=3, length_penalty=2.0),
    ]
    for p in cases:
        assert convert.params_from_pb(convert.params_to_pb(p)) == p


def test_services_have_only_called_rpcs():
    """The RPCs nobody called (Worker.Abort, GetAgentMetadata; Router.Register, Heartbeat, KvEvents) are gone;
    each remaining one has a caller: the gateway (Generate, Prefill, GenerateFromPrefill, ReleaseKV, Route,
    ListWorkers), the decode worker (ReleaseKV, KvHandshake), operators and tests (GetStats), `pdserve
    worker-role` and the planner's local connector (SwitchRole)."""
    from pdserve.services.pb import router_pb2, worker_pb2
    worker = {m.name for m in worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods}
    router = {m.name for m in router_pb2.DESCRIPTOR.services_by_name["Router"].methods}
    assert worker == {"Generate", "Prefill", "GenerateFromPrefill", "ReleaseKV", "KvHandshake", "GetStats",
                      "SwitchRole"}
    assert router == {"Route", "ListWorkers"}


def test_lifecycle_fields_round_trip_with_presence():
    from pdserve.services.convert import RequestLimits, lifecycle_to_pb, limits_from_pb
    from pdserve.services.pb import worker_pb2
    req = worker_pb2.PrefillRequest(lifecycle=lifecycle_to_pb(1.7e9 + 0.25, 3, 120))
    back = worker_pb2.PrefillRequest.FromString(req.SerializeToString())
    assert limits_from_pb(back.lifecycle) == RequestLimits(1.7e9 + 0.25, 3, 120)
    # absent stays absent (engine defaults), and 0 is a value, not "unset"
    assert limits_from_pb(worker_pb2.PrefillRequest().lifecycle) == RequestLimits(None, 0, None)
    assert limits_from_pb(lifecycle_to_pb(0.0, None, 0)) == RequestLimits(0.0, 0, 0)
