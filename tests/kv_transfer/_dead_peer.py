"""Run as a script: ROUNDS times, pull from a peer, kill it, fail a pull, close the agent (tests/kv_transfer/
test_kv_transfer.py::test_closing_an_agent_after_its_peer_died_does_not_abort)."""
import multiprocessing as mp
import sys

import torch

from pdserve.kv_transfer.agent import KVAgent, KVTransferError, TransferFailure
from tests.kv_transfer import _peer


def main(rounds: int) -> None:
    ctx = mp.get_context("spawn")
    peers = []
    for i in range(rounds):  # started together: their start-ups (a torch import each) overlap
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_peer.serve, args=(child, f"doomed-{i}", i, {}), daemon=True)
        p.start()
        peers.append((p, parent))
    for i, (p, conn) in enumerate(peers):
        assert conn.poll(60), "peer did not start"
        region = conn.recv()
        agent = KVAgent(f"survivor-{i}", torch.zeros(_peer.SHAPE), _peer.layout())
        agent.read_blocks(region, [1], [1])
        p.kill()
        p.join(5)
        try:
            agent.read_blocks(region, [2], [2], timeout_s=3)
            raise AssertionError("a READ from a killed peer succeeded")
        except KVTransferError as e:
            assert e.kind is TransferFailure.PEER_GONE, e
        agent.close()  # destroys the NIXL agent: where UCX aborted
        print(f"round {i} closed", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
