"""One import point for the generated stubs (conversions to and from them: services/convert.py)."""
from __future__ import annotations

from pdserve._proto.pdserve.v1 import common_pb2, gateway_pb2_grpc, router_pb2, router_pb2_grpc  # noqa: F401
from pdserve._proto.pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: F401
