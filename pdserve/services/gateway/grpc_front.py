"""The gateway's gRPC front door (`Gateway.Generate`): the HTTP API's request path for gRPC clients.

Trust model: the same as the HTTP API's. The caller's API key travels as `authorization: Bearer <key>` (or
`x-api-key`) metadata and is checked against the same keys file; the tenant's rate limit and quota, the
deadline (the call's gRPC deadline, capped like an HTTP `timeout`), KV admission and the one billing record all
apply. The prefix-cache namespace is the tenant's: a `namespace` in the request is ignored, so a caller cannot
read another tenant's cached prefixes. Errors map to gRPC codes (401 -> UNAUTHENTICATED, 429/503 ->
RESOURCE_EXHAUSTED / UNAVAILABLE with the retry hint in the message, 400 -> INVALID_ARGUMENT, 504 ->
DEADLINE_EXCEEDED).
"""
from __future__ import annotations

import contextlib

import grpc

from pdserve.services.admission import AdmissionError, lifecycle_metadata
from pdserve.services.gateway.core import Dispatcher, NoWorkersError, UpstreamError, new_id, split
from pdserve.services.gateway.lifecycle import Lifecycle
from pdserve.services.gateway.params import APIError
from pdserve.services.pb import gateway_pb2_grpc, params_from_pb

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
           413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
           503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


class GatewayGrpc(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, life: Lifecycle, dispatcher: Dispatcher, tokenizer, vocab_size: int, max_model_len: int):
        self.life, self.disp, self.tok = life, dispatcher, tokenizer
        self.vocab, self.max_len = vocab_size, max_model_len

    def _prompt(self, request) -> list[int]:
        ids = list(request.prompt_token_ids) or self.tok.encode(request.prompt)
        if not ids:
            raise APIError(400, "empty prompt", param="prompt", code="invalid_parameter")
        if len(ids) >= self.max_len:
            raise APIError(400, f"prompt has {len(ids)} tokens; the context is {self.max_len} tokens including "
                           "output", param="prompt", code="context_length_exceeded")
        if any(t < 0 or t >= self.vocab for t in ids):
            raise APIError(400, "token id outside the vocabulary", param="prompt_token_ids",
                           code="invalid_parameter")
        return ids

    async def Generate(self, request, context):
        life = self.life
        rec = life.new_record()
        failure: tuple[grpc.StatusCode, str] | None = None
        try:
            rec.tenant = life.gate.authenticate(dict(context.invocation_metadata() or ()))
            await life.gate.check_limits(rec.tenant)
            params = params_from_pb(request.params)
            try:
                params.validate(self.vocab)
            except ValueError as e:
                raise APIError(400, str(e), code="invalid_parameter") from None
            ids = self._prompt(request)
            remaining = context.time_remaining()
            deadline = life.deadline_for({} if remaining is None else {"timeout": max(remaining, 1e-3)}, rec)
            rid = request.request_id or new_id("grpc")
            ticket = await life.admit(rec, rid, [ids], params.max_tokens, params.n, self.max_len,
                                      allow_degrade=False)
            md = lifecycle_metadata(deadline, rec.tenant.priority,
                                    ticket.predicted_output if ticket is not None else None)
            agen = self.disp.generate_many(rid, split([ids], params), rec.tenant.namespace, metadata=md)
            end_state, error, cached = "FINISHED", None, 0
            async with contextlib.aclosing(agen):
                async for _, m in agen:
                    ntok = sum(len(o.token_ids) for o in m.outputs)
                    rec.emitted += ntok  # handed to the stream here
                    rec.generated = rec.emitted
                    if m.finished:
                        cached += m.usage.cached_tokens
                        if m.state and m.state != "FINISHED":
                            end_state, error = m.state, m.error or m.state
                    m.request_id = rid
                    yield m
            rec.committed = rec.emitted
            rec.cached_tokens = cached
            await life.finish(rec, end_state, error)
        except AdmissionError as e:
            await life.finish(rec, e.state, e.message)
            failure = (_STATUS.get(e.status, grpc.StatusCode.UNAVAILABLE), f"{e.code}: {e.message}")
        except APIError as e:
            await life.finish(rec, "REJECTED", e.message)
            failure = (_STATUS.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), f"{e.code or e.type}: {e.message}")
        except NoWorkersError as e:
            await life.finish(rec, "REJECTED", str(e))
            failure = (grpc.StatusCode.UNAVAILABLE, f"no workers available: {e}")
        except UpstreamError as e:
            await life.finish(rec, "FAILED", str(e))
            failure = (e.code, e.details)
        finally:
            if rec.state is None:  # the caller cancelled: what was streamed is billed
                rec.committed = rec.emitted
                await life.finish(rec, "CANCELLED", "client cancelled")
        if failure is not None:
            await context.abort(*failure)
