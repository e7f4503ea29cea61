#!/usr/bin/env bash
# The whole suite: lint, import contracts, type check, unit tests, then the real-cluster tests.
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate

echo "== ruff"
ruff check .
ruff format --check .

echo "== hadolint (the images' Dockerfile)"
hadolint Dockerfile

echo "== import contracts (the layers in .importlinter)"
lint-imports

echo "== type check (basedpyright: every flotilla.* import resolves)"
basedpyright --level error

echo "== control-plane binaries (built once per version, cached outside the repo)"
flotilla cluster build

echo "== pytest"
set +e
python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "make test: pytest collected no tests; that is a failure, not a pass" >&2
  exit 1
fi
exit "$status"
