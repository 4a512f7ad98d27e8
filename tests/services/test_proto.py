"""The checked-in stubs are exactly what `python -m pdserve.proto_gen` produces, and conversions round-trip."""

from pdserve import proto_gen
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams
from pdserve.services import pb


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
    ]
    for p in cases:
        assert pb.params_from_pb(pb.params_to_pb(p)) == p
