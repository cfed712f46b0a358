#!/bin/sh
# Run the benchmark suite from anywhere: benchmarks/run.sh [--quick] [options]
# (python -m benchmarks run --help lists the options). PYTHON overrides the interpreter.
set -e
cd "$(dirname "$0")/.."
exec "${PYTHON:-/opt/lm-venv/bin/python}" -m benchmarks run "$@"
