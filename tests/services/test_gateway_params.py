"""OpenAI body -> SamplingParams mapping, and error bodies naming the field."""
import json

import pytest

from pdserve.services.gateway.core import split
from pdserve.services.gateway.params import APIError, to_sampling_params


def sp(body, chat=False):
    return to_sampling_params(body, chat=chat, vocab_size=320)


def test_mapping():
    p = sp({"temperature": 0, "top_p": 0.5, "top_k": 4, "min_p": 0.1, "seed": 3, "max_tokens": 7, "stop": "x",
            "n": 2, "logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"5": 10}})
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed, p.max_tokens, p.stop, p.n, p.logprobs) == \
        (0.0, 0.5, 4, 0.1, 3, 7, ["x"], 2, 2)
    assert p.presence_penalty == 0.5 and p.frequency_penalty == -0.5 and p.logit_bias == {5: 10.0}
    assert sp({}).max_tokens == 16 and sp({}, chat=True).max_tokens is None
    c = sp({"max_completion_tokens": 9, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}, chat=True)
    assert c.max_tokens == 9 and c.logprobs == 2
    g = sp({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}})
    assert json.loads(g.guided.json_schema) == {"type": "object"}
    assert sp({"response_format": {"type": "json_object"}}).guided.json_object


@pytest.mark.parametrize("body,param", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                        ({"max_tokens": "x"}, "max_tokens"), ({"n": 0}, "n"),
                                        ({"stop": [1]}, "stop"), ({"logit_bias": {"999": 1}}, None),
                                        ({"response_format": {"type": "xml"}}, "response_format.type"),
                                        ({"presence_penalty": 3}, "presence_penalty")])
def test_errors_name_the_field(body, param):
    with pytest.raises(APIError) as e:
        sp(body)
    assert e.value.status == 400
    b = e.value.body()["error"]
    assert set(b) == {"message", "type", "param", "code"} and b["type"] == "invalid_request_error"
    if param:
        assert b["param"] == param


def test_split_fans_out_n_with_distinct_seeds():
    subs = split([[1, 2], [3]], sp({"n": 2, "seed": 10}))
    assert [s.index_base for s in subs] == [0, 1, 2, 3]
    assert [s.params.seed for s in subs] == [10, 11, 10, 11] and all(s.params.n == 1 for s in subs)
    assert split([[1]], sp({"seed": 7}))[0].params.seed == 7  # n == 1 keeps the seed as given
