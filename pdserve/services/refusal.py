"""A worker refusing a request as invalid (bad parameters, a schema its grammar compiler cannot compile, a
prompt that can never fit): the request ends REJECTED, as a gateway refusal does, and the gateway answers 400
without billing it (gateway/errors.py maps INVALID_ARGUMENT to REJECTED).

The refusal is counted where every engine request's end is counted, so the worker's own metrics show REJECTED:
`pdserve_engine_requests_terminal_total{state="REJECTED"}`, `pdserve_request_state_entries_total{state=
"REJECTED"}` (the NEW -> REJECTED move of the state machine) and `pdserve_rejections_total{reason=
"invalid_request"}`.
"""
from __future__ import annotations

import grpc

from pdserve.engine.request_state import enter_rejected
from pdserve.services.grpc_util import param_metadata
from pdserve.services.metrics import worker as M


def count_rejected() -> None:
    state = enter_rejected()
    M.TERMINAL.labels(state.value).inc()
    M.REJECTIONS.labels("invalid_request").inc()


async def refuse_invalid(context, e: Exception) -> None:
    """Count the refusal and end the RPC with INVALID_ARGUMENT, naming the parameter (`pdserve-param`)."""
    count_rejected()
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e), trailing_metadata=param_metadata(e))
