"""procutil: the first SIGTERM arms a deadline; a process whose teardown hangs is gone drain + EXIT_GRACE_S later
(exit code EXIT_STUCK), one that finishes its drain exits normally."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from pdserve.services.procutil import EXIT_GRACE_S, EXIT_STUCK

SERVER = """
import asyncio, sys, time
from pdserve.services.procutil import install_stop_signals

async def main():
    stop = install_stop_signals(0.5, "test server")
    print("ready", flush=True)
    await stop.wait()
    if sys.argv[1] == "hang":
        time.sleep(60)  # a teardown stuck in a blocking call (a Redis that does not answer, a wedged step)

asyncio.run(main())
"""


@pytest.mark.parametrize("mode", ["hang", "clean"])
def test_sigterm_deadline(mode):
    p = subprocess.Popen([sys.executable, "-c", SERVER, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        code = p.wait(30)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    if mode == "hang":
        assert code == EXIT_STUCK and 0.5 + EXIT_GRACE_S - 0.1 <= took <= 0.5 + EXIT_GRACE_S + 2, (code, took)
        assert "still running" in p.stderr.read()
    else:
        assert code == 0 and took < 0.5 + EXIT_GRACE_S, (code, took)
