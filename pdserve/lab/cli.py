"""`pdserve lab`: a deployment on emulated hosts (pdserve/lab/cluster.py), served until Ctrl-C / SIGTERM."""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from pdserve.cli_args import nonneg_int, positive_float, positive_int


def _link(text: str):
    from pdserve.lab.netns import Link
    try:
        return Link.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_lab_parser(sub) -> None:
    p = sub.add_parser("lab", help="a deployment on emulated hosts: network namespaces over shaped links (root)")
    p.add_argument("--model", default="builtin", help="checkpoint dir or 'builtin'")
    p.add_argument("--prefill", type=positive_int, default=1, help="prefill hosts")
    p.add_argument("--decode", type=positive_int, default=1, help="decode hosts")
    p.add_argument("--link", type=_link, default="", metavar="RATE[,delay=MS,jitter=MS,loss=PCT]",
                   help="every worker host's link, e.g. 10gbit or 100mbit,delay=2ms (delay/jitter: netem, else "
                        "iptables' NFQUEUE; loss: netem, else nft); default: unshaped")
    p.add_argument("--num-gpu-blocks", type=nonneg_int, default=0, help="KV blocks per worker (0: the engine's)")
    p.add_argument("--heartbeat-ttl", type=positive_float, default=3.0,
                   help="the router's and every worker's registry TTL, seconds (how fast a cut host leaves the pool)")
    p.add_argument("--ucx-tls", default="tcp",
                   help="UCX transports between hosts (tcp: what a cluster without RDMA has; empty: UCX's choice, "
                        "which takes shared memory between namespaces and bypasses the links)")
    p.set_defaults(func=cmd_lab)


def cmd_lab(a) -> int:
    from pdserve.lab.cluster import LabCluster, LabSpec
    from pdserve.lab.netns import LabUnavailable
    link = a.link if not isinstance(a.link, str) else _link(a.link)
    spec = LabSpec(model=a.model, prefill=a.prefill, decode=a.decode, link=link, ucx_tls=a.ucx_tls,
                   heartbeat_ttl=a.heartbeat_ttl,
                   engine_args=("--num-gpu-blocks", str(a.num_gpu_blocks)) if a.num_gpu_blocks else ())
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster = LabCluster(spec)
    except LabUnavailable as e:
        print(f"pdserve lab: {e}", file=sys.stderr)
        return 2
    try:
        cluster.start()
        hosts = ", ".join(f"{h.name} {h.ip}" for h in cluster.net.hosts.values())
        print(f"pdserve lab: ready at {cluster.base_url}/v1 (hosts: {hosts})", flush=True)
        while not stop.wait(0.5):
            cluster.sup.poll()
    finally:
        cluster.close()
    return 0
