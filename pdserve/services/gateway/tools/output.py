"""How one request's choices are read back: the deployment's parser and the request's `parallel_tool_calls`.

A streamed choice and a whole one are read by the same `ToolStreamer` (a whole one is fed its text at once), so
the two renderings agree on what is a call, including one cut by `max_tokens` (sent with the arguments it has, as
OpenAI does) and text that only looks like a call (content).

A named tool choice (`forced`) begins the call in the prompt (the parser's `forced_call` head) and samples only
the arguments: the text the reader sees is that head, the sampled arguments and, when they ended (finish reason
`stop`), the call's closing text.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.gateway.tools.base import ParsedOutput, ToolCallParser
from pdserve.services.gateway.tools.stream import ToolStreamer


class ChoiceReader:
    """One choice's tool-call reading, fed the sampled text as it comes."""

    def __init__(self, parser: ToolCallParser, max_calls: int | None, forced: tuple[str, str] | None):
        self.streamer = ToolStreamer(parser, max_calls)
        self.forced = forced
        if forced is not None:
            self.streamer.feed(forced[0])  # a call's head, never content: the reader holds it

    @property
    def called(self) -> bool:
        return self.streamer.called

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        return self.streamer.feed(delta)

    def finish(self, finish_reason: str | None = "stop") -> tuple[str, list[dict]]:
        """The choice ended: what is still held. A forced call whose arguments ended gets its closing text."""
        text, calls = "", []
        if self.forced is not None and finish_reason == "stop":
            text, calls = self.streamer.feed(self.forced[1])
        rest, more = self.streamer.finish()
        return text + rest, calls + more


def assemble(deltas: list[dict]) -> list[dict]:
    """tool_calls deltas -> the calls, as a client accumulates them (id and name first, then the arguments)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            calls[d["index"]] = {"id": d["id"], "type": "function",
                                 "function": {"name": d["function"]["name"], "arguments": ""}}
        calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[k] for k in sorted(calls)]


@dataclass
class ToolOutput:
    parser: ToolCallParser
    parallel: bool = True  # False: at most one call per choice (the first)
    forced: tuple[str, str] | None = None  # a named choice: the call's text before and after its arguments

    def parse(self, text: str) -> ParsedOutput:
        out = self.parser.parse(text)
        if not self.parallel:
            out.calls = out.calls[:1]
        return out

    def streamer(self) -> ChoiceReader:
        return ChoiceReader(self.parser, None if self.parallel else 1, self.forced)

    def message(self, text: str, finish_reason: str | None = "stop") -> tuple[dict, bool]:
        """A whole choice's assistant message, and whether it holds calls: what its stream would have sent."""
        r = self.streamer()
        content, deltas = r.feed(text)
        rest, more = r.finish(finish_reason)
        content, deltas = content + rest, deltas + more
        if not deltas:
            return {"role": "assistant", "content": content}, False
        return {"role": "assistant", "content": content.strip() or None, "tool_calls": assemble(deltas)}, True
