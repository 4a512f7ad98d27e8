#!/usr/bin/env bash
# The test suite, exactly as CI runs it. Needs Redis on 127.0.0.1:6379 (started here if it is not running).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
fi
.venv/bin/ruff check --quiet .  # lint (pyproject.toml [tool.ruff]): a finding fails the run before any test
exec .venv/bin/python -m pytest "$@"
