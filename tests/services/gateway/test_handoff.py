"""A stream a switching worker handed on (reason `handoff`, gateway/migration.py) moves like a broken one, resumed
from the tokens sent, but the worker is not held suspect and the move is outside `--migration-limit`; a real
break under the same limit still ends the request. The Dispatcher's move loop, its placements stubbed."""
import asyncio

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.gateway.dispatch import Dispatcher, SubRequest
from pdserve.services.gateway.migration import HANDOFF, UNAVAILABLE, Broken
from pdserve.services.gateway.stages import StageTrace
from pdserve.services.pb import common_pb2


class _Placements(Dispatcher):
    """Each placement sends one token (its own number), then breaks with the next reason, or finishes."""

    def __init__(self, breaks: list[str], limit: int):
        super().__init__("127.0.0.1:1", "m", migration_limit=limit)
        self.breaks, self.resumes = list(breaks), []

    async def _place(self, rid, sub, namespace, on_route, trace, lifecycle, exclude, resume, first=None):
        self.resumes.append(resume)
        k = len(self.resumes)
        yield common_pb2.GenerateResponse(request_id=rid, outputs=[common_pb2.CompletionDelta(index=0,
                                                                                              token_ids=[k])])
        if self.breaks:
            raise Broken(f"w{k}", self.breaks.pop(0), f"worker w{k} went")
        yield common_pb2.GenerateResponse(request_id=rid, finished=True, state="FINISHED")


def _run(breaks: list[str], limit: int) -> tuple[_Placements, list[common_pb2.GenerateResponse], StageTrace]:
    trace = StageTrace()

    async def main():
        d = _Placements(breaks, limit)  # its router channel needs the running loop
        sub = SubRequest([5, 6], SamplingParams(max_tokens=8), 0)
        return d, [m async for m in d.generate("r", sub, trace=trace)]

    d, msgs = asyncio.run(main())
    return d, msgs, trace


def test_handoffs_move_outside_the_limit_and_leave_no_suspect():
    d, msgs, trace = _run([HANDOFF, HANDOFF], limit=0)
    assert msgs[-1].state == "FINISHED" and [list(m.outputs[0].token_ids) for m in msgs[:-1]] == [[1], [2], [3]]
    assert d.resumes == [None, [1], [1, 2]]  # each placement resumes from every token the client has
    assert trace.migrations == 2 and d.suspects.current() == []


def test_a_real_break_still_spends_the_limit():
    d, msgs, trace = _run([HANDOFF, UNAVAILABLE], limit=0)
    assert msgs[-1].state == "FAILED" and "migration limit reached" in msgs[-1].error, msgs[-1]
    assert d.resumes == [None, [1]] and d.suspects.current() == ["w2"]
