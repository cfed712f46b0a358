#!/bin/sh
# Run the benchmark suite from anywhere: benchmarks/run.sh [--quick] [options]
# (python -m benchmarks run --help lists the options). PYTHON overrides the interpreter;
# the default is the one packaging/setup.sh installs (LAKEFS_MOUNT_VENV, as there).
set -e
cd "$(dirname "$0")/.."
exec "${PYTHON:-${LAKEFS_MOUNT_VENV:-/opt/lakefs-mount/venv}/bin/python}" -m benchmarks run "$@"
