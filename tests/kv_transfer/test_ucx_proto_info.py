"""UCX's protocol-selection report read back (kv_transfer/ucx_proto_info.py, ucx_log.py), on lines this UCX
(nixl-cu12's) wrote, verbatim: a READ between two processes of one host with UCX's defaults (cma), the same with
UCX_TLS=tcp (emulated over tcp), the loopback endpoint's PUT NIXL makes at start, and an error line.
The expected Selections are read off the tables by hand; a decode side reads the report once per peer
incarnation. The worker pair that produces such lines for real is
tests/services/worker/test_kv_pair_metrics.py."""
import logging
import os

from pdserve.kv_transfer.ucx_log import UcxLog
from pdserve.kv_transfer.ucx_proto_info import UNKNOWN, Selection, TableParser, message, observed

CMA = """\
[1796472270.894884] [vm:26007:0]   +--------+-------------+-------------------------------------------+
[1796472270.894884] [vm:26007:0]   | me intra-node cfg#1                                              |
[1796472270.894884] [vm:26007:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796472270.894884] [vm:26007:0]   +--------+-------------+-------------------------------------------+
[1796472270.894884] [vm:26007:0]   | Range  | Description |                  Config                   |
[1796472270.894884] [vm:26007:0]   +--------+-------------+-------------------------------------------+
[1796472270.894884] [vm:26007:0]   | 0..inf | zero-copy   | cma/memory                                |
[1796472270.894884] [vm:26007:0]   +--------+-------------+-------------------------------------------+
"""
TCP = """\
[1796472264.006583] [vm:25937:0]   +--------+--------------------+------------------------------------+
[1796472264.006583] [vm:25937:0]   | me intra-node cfg#1                                              |
[1796472264.006583] [vm:25937:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1796472264.006583] [vm:25937:0]   +--------+--------------------+------------------------------------+
[1796472264.006583] [vm:25937:0]   | Range  |    Description     |               Config               |
[1796472264.006583] [vm:25937:0]   +--------+--------------------+------------------------------------+
[1796472264.006583] [vm:25937:0]   | 0..inf | software emulation | tcp/lo                             |
[1796472264.006583] [vm:25937:0]   +--------+--------------------+------------------------------------+
"""
SELF_PUT = """\
[1796471040.096454] [vm:10794:0]   +--------+-------------+-----------------------------------+
[1796471040.096454] [vm:10794:0]   | peer self cfg#0                                          |
[1796471040.096454] [vm:10794:0]   | remote memory write by ucp_put* from host memory to host |
[1796471040.096454] [vm:10794:0]   +--------+-------------+-----------------------------------+
[1796471040.096454] [vm:10794:0]   | Range  | Description |              Config               |
[1796471040.096454] [vm:10794:0]   +--------+-------------+-----------------------------------+
[1796471040.096454] [vm:10794:0]   | 0..inf | zero-copy   | cma/memory                                |
[1796471040.096454] [vm:10794:0]   +--------+-------------+-----------------------------------+
"""
ERROR = ("[1796471547.497796] [vm:12961:0]          select.c:722  UCX  ERROR   no active messages transport to "
         "<no debug data>: posix/memory - no peer failure handler\n")
READ = "remote memory read by ucp_get*(multi) into host memory from host"


def _parse(text: str) -> list[Selection]:
    p = TableParser()
    return [s for line in text.splitlines() if (s := p.feed(message(line))) is not None]


def test_tables_become_selections():
    assert _parse(CMA) == [Selection("me", "intra-node", 1, READ, ("cma",))]
    assert _parse(TCP) == [Selection("me", "intra-node", 1, READ, ("tcp",))]
    assert _parse(SELF_PUT) == [Selection("peer", "self", 0, "remote memory write by ucp_put* from host memory to "
                                          "host", ("cma",))]
    # an error line between tables is no table (its "posix/memory" is not a selection); a cut table is dropped
    assert _parse(SELF_PUT + ERROR + CMA) == [_parse(SELF_PUT)[0], _parse(CMA)[0]]
    assert _parse("\n".join(CMA.splitlines()[:5]) + "\n" + TCP) == _parse(TCP)


def _sel(cfg: int, tl: str, worker: str = "me", locality: str = "intra-node", op: str = READ) -> Selection:
    return Selection(worker, locality, cfg, op, (tl,))


def test_a_peers_transport_is_its_own_selection_or_unknown():
    cma, tcp = _sel(1, "cma"), _sel(2, "tcp")
    assert observed("me", [cma], [cma]) == "cma"
    assert observed("me", [tcp], [cma, tcp]) == "tcp"  # the new peer's own table, not the first one met
    # nothing new (the peer reuses a configuration met before): the known ones, if they agree
    assert observed("me", [], [cma]) == "cma"
    assert observed("me", [], [cma, tcp]) == UNKNOWN
    assert observed("me", [cma, tcp], [cma, tcp]) == UNKNOWN  # two new peers at once, chosen differently
    # one configuration whose size ranges use two transports (two tables of it): both, in one name
    assert observed("me", [_sel(3, "tcp"), _sel(3, "rc_mlx5")], []) == "rc_mlx5+tcp"
    # the same index on another locality is another configuration
    assert observed("me", [_sel(3, "tcp"), _sel(3, "rc_mlx5", locality="inter-node")], []) == UNKNOWN
    # not READs, the loopback endpoint, another agent's: none of them says anything about this peer
    assert observed("me", [_sel(1, "cma", op="remote memory write by ucp_put* from host memory to host"),
                           _sel(0, "cma", locality="self"), _sel(1, "cma", worker="other")], []) == UNKNOWN


def test_the_log_is_read_across_partial_writes_and_errors_go_to_the_worker_log(tmp_path, caplog):
    path = tmp_path / "ucx.log"
    path.write_bytes(b"")
    log = UcxLog()
    log._fd = os.open(path, os.O_RDONLY)  # as open() leaves it, on a file this test writes instead of UCX
    data = (SELF_PUT + ERROR + TCP).encode()
    cut = len(SELF_PUT) + len(ERROR) + 150  # mid-line, inside the tcp table
    try:
        with caplog.at_level(logging.INFO, logger="pdserve.ucx"):
            with open(path, "ab") as f:
                f.write(data[:cut])
            m0 = log.mark()
            assert [s.locality for s in log.selections] == ["self"] and m0 == 1
            with open(path, "ab") as f:
                f.write(data[cut:])
            assert log.since(m0) == _parse(TCP)
        errors = [r for r in caplog.records if r.name == "pdserve.ucx"]
        assert [(r.levelno, "no active messages transport" in r.getMessage()) for r in errors] == [
            (logging.ERROR, True)]
    finally:
        log.close()


class _CountingLog(UcxLog):
    def __init__(self, path):
        super().__init__()
        self._fd = os.open(path, os.O_RDONLY)  # as open() leaves it, on a file the test writes instead of UCX
        self.marks = 0

    def mark(self) -> int:
        self.marks += 1
        return super().mark()


def test_a_decode_worker_reads_the_report_once_per_peer_incarnation(tmp_path):
    """Marked before the first pull from a peer incarnation, read right after it, and never again for later
    pulls from it (the hot path); the peer's sample on pdserve_kv_pair_transport_info follows, a restarted peer's
    replacing its previous one."""
    from types import SimpleNamespace

    from pdserve.kv_transfer.layout import KV_PROTOCOL_VERSION, KVLayout
    from pdserve.services.decode.service import DecodeSide
    from pdserve.services.kv_endpoint import KvEndpoint
    from pdserve.services.metrics import worker as M
    from pdserve.services.pb import common_pb2

    path = tmp_path / "ucx.log"
    path.write_bytes(b"")
    log = _CountingLog(path)
    ep = KvEndpoint("d", "127.0.0.1:1", "inc", KV_PROTOCOL_VERSION, KVLayout("fp", 16, "float32", 2, 2, 16),
                    common_pb2.KvRegion())
    side = DecodeSide(host=None, endpoint=ep, agent=SimpleNamespace(name="me"), tokenizer=None, meter=None,
                      transfer_timeout_s=1.0, ucx=log)
    two = [None, None]  # two regions (a TP peer): no self-test is started, the observation still is
    first = common_pb2.KvHandle(worker_id="ucx-peer", worker_address="10.0.0.9:1", incarnation="i1")
    try:
        side._mark_once(first)
        with open(path, "a") as f:  # UCX reports its selection for the peer's first READ
            f.write(TCP)
        side._probe_once(first, two)
        for _ in range(3):  # later pickups from the same incarnation
            side._mark_once(first)
            side._probe_once(first, two)
        assert log.marks == 1 and side.observed == {"ucx-peer": "tcp"}
        assert M.WORKER.get_sample_value("pdserve_kv_pair_transport_info",
                                         {"peer": "ucx-peer", "observed": "tcp"}) == 1
        # the peer restarted: its endpoint reuses the configuration met before, UCX reports nothing new
        again = common_pb2.KvHandle(worker_id="ucx-peer", worker_address="10.0.0.9:1", incarnation="i2")
        side._mark_once(again)
        side._probe_once(again, two)
        assert log.marks == 2 and side.observed == {"ucx-peer": "tcp"}
        side.pairs.transport("ucx-peer", "cma")  # had it chosen otherwise: one sample, the new one
        assert M.WORKER.get_sample_value("pdserve_kv_pair_transport_info",
                                         {"peer": "ucx-peer", "observed": "tcp"}) is None
        assert M.WORKER.get_sample_value("pdserve_kv_pair_transport_info",
                                         {"peer": "ucx-peer", "observed": "cma"}) == 1
    finally:
        M.KV_PAIR_TRANSPORT_INFO.remove("ucx-peer", "cma")
        log.close()
