"""Tool calling on /v1/chat/completions (docs/api.md, "Tool calling").

`request.py` reads `tools`, `tool_choice`, `parallel_tool_calls` and the tool history; one parser per model output
format (`hermes.py`, `llama3.py`, `mistral.py`, behind the small interface in `base.py`, chosen in `registry.py`)
turns the model's text into OpenAI `tool_calls` and writes the grammar that enforces `required` and named
choices; `stream.py` turns a streamed choice into content and tool-call deltas.
"""
