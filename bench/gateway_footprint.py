"""Gateway footprint: time to import the gateway's server module and build its app for the built-in model, the
resident set size after that, and whether torch was loaded (it must not be: docs/services.md, "Slim processes").

    PYTHONPATH=. python bench/gateway_footprint.py
"""
from __future__ import annotations

import asyncio
import resource
import sys
import time


def main() -> None:
    t0 = time.perf_counter()
    import pdserve.services.gateway.server  # noqa: F401
    from pdserve.services.gateway.app import GatewayConfig, create_app
    t1 = time.perf_counter()

    async def build():
        return create_app(GatewayConfig("builtin", "builtin", "127.0.0.1:1"))

    asyncio.run(build())
    t2 = time.perf_counter()
    with open("/proc/self/status") as f:
        rss_mib = int(f.read().split("VmRSS:")[1].split()[0]) / 1024
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"import {t1 - t0:.2f} s, import + app {t2 - t0:.2f} s, RSS {rss_mib:.0f} MiB (peak {peak_mib:.0f} MiB), "
          f"torch loaded: {'torch' in sys.modules}")


if __name__ == "__main__":
    main()
