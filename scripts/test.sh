#!/usr/bin/env bash
# The test suite, exactly as CI runs it. Needs Redis on 127.0.0.1:6379 (started here if it is not running).
#   bash scripts/test.sh            lint, then everything: the unit tests on two pytest-xdist workers, then the
#                                   whole deployments (-m e2e) one at a time (docs/testing.md, "Two phases")
#   bash scripts/test.sh ARGS...    lint, then one pytest run with ARGS (add -n 2 to spread it over two workers)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no >/dev/null
fi
.venv/bin/ruff check --quiet .  # lint (pyproject.toml [tool.ruff]): a finding fails the run before any test
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
start=$SECONDS
rc=0
.venv/bin/python -m pytest -m "not e2e" -n 2 --dist loadgroup || rc=$?
echo "unit phase: $((SECONDS - start)) s (exit $rc)"
.venv/bin/python -m pytest -m e2e || rc=$((rc ? rc : $?))
echo "whole suite: $((SECONDS - start)) s"
exit "$rc"
