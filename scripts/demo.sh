#!/usr/bin/env bash
# `make demo`: build (or reuse) the control-plane binaries, start the local cluster, then run the operator
# and end with a Ready InferenceService answering one completion.
set -euo pipefail
cd "$(dirname "$0")/.."
source .venv/bin/activate

echo "== control-plane binaries (first build takes a while; cached per version afterwards)"
flotilla cluster build

echo "== starting the local cluster"
flotilla cluster up

echo "== the platform on it: operator, Tenant, InferenceService, one completion"
flotilla demo
