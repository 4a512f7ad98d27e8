"""`POST /v1/responses`, OpenAI's Responses API for text models, as a translation over the chat completions path.

A Responses body is checked (fields.py) and turned into the chat body it means (request.py); from there it takes
the one request path every chat completion takes (admission, billing, deadlines, cancellation, both serving modes:
app.py's `_endpoint` and handler.py). The answer comes back as chat completion JSON or chunks and is rewritten as a
Response object (output.py) or the Responses API's typed events (events.py). Unless `store: false`, the
conversation a response ends is kept in Redis for `previous_response_id` (store.py: tenant-scoped, expiring,
bounded).
"""
