#!/usr/bin/env bash
# Serving comparison (pdserve disaggregated and colocated, vLLM CPU, transformers), with the
# repo's virtualenv, from the repository root. Flags go to `python -m bench.serving.compare`;
# see `bench/serving/compare.sh --help`.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/python -m bench.serving.compare "$@"
