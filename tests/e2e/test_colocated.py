"""`pdserve up --mode colocated`: one `both` worker serves whole requests."""
import pytest

from tests.e2e import _common


@pytest.fixture
def up(colocated_ck):
    """Shared with other modules (tests/e2e/conftest.py); stopping it asserts a clean exit (SIGTERM: `up` exits 0)
    and that every child (redis, router, workers, gateway) is gone."""
    return colocated_ck


def test_greedy_matches_offline_engine(up, offline_greedy):
    _common.check_greedy_batch(up, offline_greedy)


def test_seeded_sampling_matches_offline_engine(up, offline_seeded):
    assert _common.seeded_ids(up) == offline_seeded


def test_openai_client(up):
    _common.check_openai_client(up)


def test_disconnect_frees_blocks(up):
    _common.check_disconnect_frees_blocks(up)


def test_stage_times(up):
    _common.check_stage_times(up)


def test_echo_prompt_logprobs(up, tiny_llama):
    _common.check_echo(up, tiny_llama)


def test_worker_refusal_names_the_field(up):
    _common.check_worker_refusal_names_the_field(up)


def test_n_branches_share_one_prefill(up, tiny_llama):
    _common.check_n_branches(up, tiny_llama)
