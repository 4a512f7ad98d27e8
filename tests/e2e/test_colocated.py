"""`pdserve up --mode colocated`: one `both` worker serves whole requests."""
import os

import pytest

from tests.e2e import _common
from tests.e2e.conftest import Up


@pytest.fixture(scope="module")
def up(tiny_llama):
    import shutil
    model = tiny_llama.parent / "ck"
    if not model.exists():
        shutil.copytree(tiny_llama, model)  # served model name = dir basename "ck"
    d = Up(model, "--mode", "colocated", "--workers", "1")
    yield d
    assert d.stop() == 0  # SIGTERM: clean exit
    for proc in d.info["processes"]:  # and every child (redis, router, workers, gateway) is gone
        try:
            os.kill(proc["pid"], 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"{proc['name']} still running after pdserve up stopped")


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
