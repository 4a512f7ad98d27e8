"""OpenAI body -> SamplingParams mapping, and error bodies naming the field."""
import json

import pytest

from pdserve.services.gateway.dispatch import split
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


def test_split_one_engine_request_per_prompt_with_all_branches():
    """n > 1 (and best_of) travel whole to one worker: the engine forks the branches over one prompt prefill;
    prompt i's branch j is choice i * n + j."""
    subs = split([[1, 2], [3]], sp({"n": 2, "seed": 10}))
    assert [s.index_base for s in subs] == [0, 2] and [s.prompt_token_ids for s in subs] == [[1, 2], [3]]
    assert all((s.params.n, s.params.seed, s.n_choices) == (2, 10, 2) for s in subs)
    b = split([[1]], sp({"n": 2, "best_of": 3}))
    assert len(b) == 1 and (b[0].params.n, b[0].params.best_of, b[0].n_choices) == (2, 3, 2)


def test_best_of():
    """best_of >= n; best_of > n (OpenAI's rule) cannot be streamed; best_of == n is plain n; chat has none."""
    assert sp({"n": 1, "best_of": 3}).best_of == 3 and sp({"n": 1, "best_of": 3}).num_branches == 3
    assert sp({"n": 2, "best_of": 2}).best_of is None
    assert sp({"best_of": 3}, chat=True).best_of is None
    assert sp({"n": 2, "best_of": 2, "stream": True}).n == 2
    for body in ({"n": 3, "best_of": 2}, {"best_of": 3, "stream": True}, {"best_of": 0}, {"best_of": 129}):
        with pytest.raises(APIError) as e:
            sp(body)
        assert e.value.status == 400 and e.value.param == "best_of", body


def test_echo():
    from pdserve.services.gateway.params import prompt_only
    p = sp({"echo": True, "max_tokens": 0, "logprobs": 1})
    assert p.max_tokens == 1 and p.prompt_logprobs == 1 and p.logprobs == 1  # one token sampled, not returned
    assert prompt_only({"echo": True, "max_tokens": 0}) and not prompt_only({"echo": True, "max_tokens": 1})
    assert sp({"echo": True, "max_tokens": 3}).prompt_logprobs is None  # no logprobs asked: none computed
    assert sp({"echo": True, "logprobs": 0}).prompt_logprobs == 0
    for body, chat, param in (({"max_tokens": 0}, False, "max_tokens"), ({"echo": True}, True, "echo"),
                              ({"echo": True, "stream": True}, False, "echo"), ({"echo": "yes"}, False, "echo")):
        with pytest.raises(APIError) as e:
            sp(body, chat=chat)
        assert e.value.status == 400 and e.value.param == param, body


def test_engine_refusals_name_their_parameter_typed():
    """The engine's InvalidParameter carries the field; the gateway reports it without reading the text, and a
    worker's refusal (its pdserve-param trailing metadata) names the client's field."""
    import grpc

    from pdserve.services.gateway.dispatch import UpstreamError
    from pdserve.services.gateway.errors import reply_for
    with pytest.raises(APIError) as e:
        sp({"logit_bias": {"999": 1}})
    assert e.value.param == "logit_bias" and "999" in e.value.message
    r = reply_for(UpstreamError(grpc.StatusCode.INVALID_ARGUMENT, "invalid sampling parameter 'guided.json_schema': "
                                "Cannot find field 'nope'", "guided.json_schema"))
    assert (r.status, r.param, r.code) == (400, "response_format", "invalid_parameter")
    assert r.state == "REJECTED"  # the worker ran nothing: not billed, like the gateway's own refusals
    assert reply_for(UpstreamError(grpc.StatusCode.INVALID_ARGUMENT, "'x' is wrong")).param is None  # no guessing
