"""The side channel between rank 0 and another rank (engine/tp/side_channel.py): replies match their requests
when requests overlap, a handler's exception comes back as RuntimeError, a closed peer fails what is pending."""
import socket
import threading
import time

import pytest

from pdserve.engine.tp.side_channel import SideChannel


def test_overlapping_requests_get_their_own_replies_and_errors():
    a, b = socket.socketpair()
    release = threading.Event()

    def handle(msg):
        if msg == "slow":
            release.wait(5)
        if msg == "boom":
            raise KeyError("no such thing")
        return ("echo", msg)

    SideChannel(b, handle, name="rank1")
    rank0 = SideChannel(a, name="rank0")
    slow, fast, bad = rank0.call("slow"), rank0.call({"x": [1, 2]}), rank0.call("boom")
    assert fast.result(5) == ("echo", {"x": [1, 2]})  # not held up behind the slow one
    with pytest.raises(RuntimeError, match="no such thing"):
        bad.result(5)
    assert not slow.done()
    release.set()
    assert slow.result(5) == ("echo", "slow")


def test_a_vanished_rank_fails_pending_and_later_calls():
    a, b = socket.socketpair()
    SideChannel(b, lambda m: time.sleep(10), name="rank1")
    rank0 = SideChannel(a, name="rank0")
    pending = rank0.call("anything")
    b.shutdown(socket.SHUT_RDWR)  # the rank's end goes away (its process died)
    b.close()
    with pytest.raises(ConnectionError):
        pending.result(5)
    with pytest.raises(ConnectionError):
        rank0.call("again").result(5)
