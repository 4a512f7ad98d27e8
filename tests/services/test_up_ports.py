"""`ports.free_port` (what `up` starts its children on): ports are chosen below the kernel's ephemeral range (where
outgoing connections and other bind(0) calls cannot take them between the choice and the child's bind), are
bindable when handed out, and are never handed out twice by one process."""
import socket

from pdserve.services.ports import _ephemeral_low, free_port


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
    import pytest

    from pdserve.services import ports
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

    monkeypatch.setattr(ports.random, "Random", Draws)
    try:
        assert free_port() == port + 200
    finally:
        held.close()
