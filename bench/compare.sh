#!/usr/bin/env bash
# Serving comparison (pdserve disaggregated and colocated, vLLM CPU, transformers), with the
# repo's virtualenv. Flags go to bench/compare.py; see `bench/compare.sh --help`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python bench/compare.py "$@"
