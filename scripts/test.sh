#!/usr/bin/env bash
# The test suite, exactly as CI runs it. Needs Redis on 127.0.0.1:6379 (started here if it is not running).
#   bash scripts/test.sh            lint, then everything: all but the latency-bound deployments on two pytest-xdist
#                                   workers (whole modules each), then those (-m alone) one at a time
#                                   (docs/testing.md, "Two phases")
#   bash scripts/test.sh ARGS...    lint, then one pytest run with ARGS (add -n 2 --dist loadfile to spread it)
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
# loadfile: a module's tests stay on one worker, so its shared deployment starts once (pytest 9.2 ignores
# xdist_group marks under --dist loadgroup: pytest-xdist issue 1386)
.venv/bin/python -m pytest -m "not alone" -n 2 --dist loadfile || rc=$?
echo "shared phase: $((SECONDS - start)) s (exit $rc)"
.venv/bin/python -m pytest -m alone || rc=$((rc ? rc : $?))
echo "whole suite: $((SECONDS - start)) s"
exit "$rc"
