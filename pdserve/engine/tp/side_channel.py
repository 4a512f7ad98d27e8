"""Requests from rank 0 to one other rank outside the step plans: one end of a socketpair per rank.

The step plans (comm.broadcast_object) are synchronous with the forward, but some work on a rank's own pool
runs beside the steps, on rank 0's time: a NIXL READ of a peer's KV into this rank's share of the heads
(kv_transfer/tp_ranks.py) may take longer than a step, and must not hold the step loop. Messages are pickled
(trusted: the two ends are one worker's processes); each request is served in its own thread on the rank, so a
long READ does not hold up a short request behind it. A closed socket (rank 0 gone, or the rank gone) fails every
pending request at once.
"""
from __future__ import annotations

import itertools
import pickle
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

_HEADER = struct.Struct("!Q")


@dataclass
class RemoteFailure:
    """The handler raised: its repr, re-raised as RuntimeError by the caller."""
    text: str


class SideChannel:
    def __init__(self, sock: socket.socket, handler: Callable[[object], object] | None = None, name: str = ""):
        """`handler`: the serving side's function of a request (on rank r); None on rank 0's side."""
        self._sock = sock
        self._handler = handler
        self._send_lock = threading.Lock()
        self._seq = itertools.count()
        self._waiting: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._read_loop, name=f"tp-side-{name}", daemon=True).start()

    def call(self, msg: object) -> Future:
        """Send a request; the Future resolves to the handler's reply (RuntimeError if it raised, ConnectionError
        if the other end is gone)."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(ConnectionError("tensor parallel rank side channel is closed"))
                return fut
            seq = next(self._seq)
            self._waiting[seq] = fut
        try:
            self._send((seq, False, msg))
        except OSError as e:
            with self._lock:
                self._waiting.pop(seq, None)
            fut.set_exception(ConnectionError(f"tensor parallel rank side channel: {e}"))
        return fut

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _send(self, obj: object) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._sock.sendall(_HEADER.pack(len(data)) + data)

    def _recv_exact(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def _read_loop(self) -> None:
        try:
            while True:
                hdr = self._recv_exact(_HEADER.size)
                if hdr is None:
                    break
                body = self._recv_exact(_HEADER.unpack(hdr)[0])
                if body is None:
                    break
                seq, is_reply, payload = pickle.loads(body)
                if is_reply:
                    with self._lock:
                        fut = self._waiting.pop(seq, None)
                    if fut is not None:
                        if isinstance(payload, RemoteFailure):
                            fut.set_exception(RuntimeError(payload.text))
                        else:
                            fut.set_result(payload)
                elif self._handler is not None:
                    threading.Thread(target=self._serve, args=(seq, payload), daemon=True).start()
        except OSError:
            pass
        finally:
            with self._lock:
                self._closed = True
                pending, self._waiting = list(self._waiting.values()), {}
            for fut in pending:
                fut.set_exception(ConnectionError("tensor parallel rank side channel closed"))

    def _serve(self, seq: int, payload: object) -> None:
        try:
            out = self._handler(payload)
        except Exception as e:  # sent back: the caller decides what a failed request means
            out = RemoteFailure(repr(e))
        try:
            self._send((seq, True, out))
        except OSError:  # rank 0 is gone: this process dies with it (PR_SET_PDEATHSIG)
            pass
