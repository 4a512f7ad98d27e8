"""`ports.free_port` (what `up` starts its children on): ports are chosen below the kernel's ephemeral range (where
outgoing connections and other bind(0) calls cannot take them between the choice and the child's bind), are
bindable when handed out, and are never handed out twice by one process."""
import socket

import pytest

from pdserve.services import ports
from pdserve.services.ports import _ephemeral_low, free_port


@pytest.fixture(autouse=True)
def own_ledger(tmp_path, monkeypatch):
    """Each test its own cross-process ledger: the machine's would carry this test's claims into the next run."""
    monkeypatch.setattr(ports, "_ledger_path", lambda: str(tmp_path / "ports.json"), raising=False)


def test_ports_below_the_ephemeral_range_distinct_and_bindable():
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    if low > 12000:
        assert all(10000 <= p < low for p in ports), (low, ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when handed out (nothing else took it since)


def test_a_taken_port_is_skipped(monkeypatch):
    """The chooser's first draw is a port something else holds: it is skipped, the next draw is handed out."""
    if _ephemeral_low() <= 12000:
        pytest.skip("ephemeral range starts too low on this host")
    held = socket.socket()
    for port in range(10000, 10100):
        try:
            held.bind(("127.0.0.1", port))
            break
        except OSError:
            continue
    draws = iter([port, port, port + 200])

    class Draws:
        def randrange(self, a, b):
            return next(draws)

    monkeypatch.setattr(ports, "_rng", Draws)
    try:
        assert free_port() == port + 200
    finally:
        held.close()


def test_two_processes_never_choose_one_port(tmp_path, monkeypatch):
    """The race behind a deployment's "[Errno 98] Address already in use": two processes (pytest-xdist workers)
    choosing ports before either child binds. Each process only remembers its own picks, so without the shared
    ledger two choosers drawing the same random sequence hand out the same ports; with it they never do."""
    import multiprocessing as mp

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the spawned choosers' ledger
    if _ephemeral_low() <= 12000:
        pytest.skip("ephemeral range starts too low on this host")
    ctx = mp.get_context("spawn")
    with ctx.Pool(2) as pool:
        picks = pool.map(_pick_seeded, [7, 7])
    assert set(picks[0]).isdisjoint(picks[1]), sorted(set(picks[0]) & set(picks[1]))
    assert len(set(picks[0])) == len(picks[0]) == 40


def _pick_seeded(seed: int) -> list[int]:
    """In a fresh process: the chooser's random draws seeded alike in both processes, the worst case for a
    collision (every draw the other process also makes)."""
    import random as _random
    import types

    from pdserve.services import ports
    seeded = _random.Random(seed)
    ports.random = types.SimpleNamespace(Random=lambda *a: seeded)  # this module's name only
    return [ports.free_port() for _ in range(40)]
