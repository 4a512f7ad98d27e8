from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT)
    return e


class Mock:
    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.bench.mockserver", "--port", str(self.port), *args],
                                     env=env())
        end = time.monotonic() + 20
        while time.monotonic() < end:
            try:
                httpx.get(self.url + "/v1/models", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.05)
        self.proc.kill()
        raise RuntimeError("mock server did not start")

    def reset(self):
        httpx.post(self.url + "/reset", timeout=5)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def mock_factory():
    made = []

    def make(*args):
        m = Mock(*args)
        made.append(m)
        return m

    yield make
    for m in made:
        m.stop()
