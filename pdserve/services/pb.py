"""One import point for the generated stubs (conversions to and from them: services/convert.py)."""
from __future__ import annotations

from pdserve._proto.pdserve.v1 import (  # noqa: F401  # noqa: F401
    common_pb2,
    gateway_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
