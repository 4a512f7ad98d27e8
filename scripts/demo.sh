#!/usr/bin/env bash
# Start a local disaggregated deployment on the built-in model, send it one request, keep serving until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8000}
.venv/bin/pdserve up --model "${MODEL:-builtin}" --mode "${MODE:-disagg}" --port "$PORT" &
UP=$!
trap 'kill -INT $UP 2>/dev/null; wait $UP 2>/dev/null' EXIT INT TERM
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
  kill -0 $UP 2>/dev/null || { echo "pdserve up exited" >&2; exit 1; }
  sleep 0.5
done
echo "--- POST /v1/chat/completions"
curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model": "builtin", "messages": [{"role": "user", "content": "Tell me a fortune."}], "max_tokens": 48, "temperature": 0.8, "seed": 1}'
echo
echo "--- serving on http://127.0.0.1:$PORT/v1 (Ctrl-C to stop)"
wait $UP
