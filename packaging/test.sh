#!/usr/bin/env bash
# Install what is missing, then lint and run the tests.
#
#   sudo bash packaging/test.sh                    everything: what CI runs (.ci/run)
#   bash packaging/test.sh --fast                  ruff, mypy, tests/unit and tests/fs (~1 min)
#   sudo bash packaging/test.sh tests/mount -k x   a slice: pytest arguments as given
#   sudo bash packaging/test.sh --write-reliability
#                                                  also rewrite docs/reliability.md from the
#                                                  fault tests' measured rows
#
# The whole suite runs in LAKEFS_MOUNT_TEST_WORKERS pytest-xdist workers (default 2; 0 runs
# it in this process): most tests wait on S3, FUSE and the clock. Tests that change what
# the machine shares (/etc/fstab, /dev/fuse's ACL, users, fs.pipe-max-size) hold the
# `machine` lock (tests/conftest.py) one at a time. A slice, the fast tier and
# --write-reliability (its rows are collected in one process) run in this process.
#
# Runs packaging/setup.sh (Debian packages, /dev/fuse, an editable install with the test
# and frameworks extras) into a
# venv of the checkout's own, <repo>/.venv (override: LAKEFS_MOUNT_VENV), never the
# machine-wide /opt/lakefs-mount/venv nor its /usr/local/bin and /sbin links. Then
# `ruff check .`, `mypy -p lakefs_mount` and pytest from the repository root. Exit status 0
# only if ruff and mypy are clean and every test passed; pytest collecting no tests (its
# exit status 5) is a failure too.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export LAKEFS_MOUNT_VENV="${LAKEFS_MOUNT_VENV:-$REPO/.venv}"
VENV="$LAKEFS_MOUNT_VENV"
FAST_TIERS=(tests/unit tests/fs)

say() { printf 'test: %s\n' "$*"; }

fast=0
serial=0
pytest_args=()
for arg in "$@"; do
    case $arg in
        --fast) fast=1 ;;
        --write-reliability) serial=1
                             pytest_args+=("--write-reliability=$REPO/docs/reliability.md") ;;
        *) pytest_args+=("$arg") ;;
    esac
done
paths=()
has_path=0
for arg in "${pytest_args[@]+"${pytest_args[@]}"}"; do
    [[ $arg != -* && -e $REPO/${arg%%::*} ]] && has_path=1
done
workers=0
if (( fast )); then
    paths=("${FAST_TIERS[@]}")
elif (( ! has_path )); then
    paths=(tests)
    (( serial )) || workers="${LAKEFS_MOUNT_TEST_WORKERS:-2}"
fi

# systemd: only its systemd-analyze, for the test that verifies the unit (no systemd runs);
# openssl: the CA the https profiles make for a run (benchmarks/tlsca.py)
LAKEFS_MOUNT_NO_LINKS=1 LAKEFS_MOUNT_EXTRA_DEBS="systemd openssl" \
    bash "$REPO/packaging/setup.sh" --extras test,frameworks --editable
cd "$REPO"

say "ruff check ."
if ! "$VENV/bin/ruff" check .; then
    say "FAILED: ruff found lint errors (see above)"
    exit 1
fi

say "mypy -p lakefs_mount"
if ! "$VENV/bin/mypy" -p lakefs_mount; then
    say "FAILED: mypy found type errors in the core packages (see above)"
    exit 1
fi

# --durations: the slowest tests of every run, where the suite's time goes
args=(-q -ra --timeout=600 --durations=25)
if (( workers > 0 )); then
    args+=(-n "$workers")
fi
args+=("${paths[@]+"${paths[@]}"}" "${pytest_args[@]+"${pytest_args[@]}"}")
say "pytest ${args[*]}"
started=$SECONDS
rc=0
"$VENV/bin/python" -m pytest "${args[@]}" </dev/null || rc=$?
elapsed=$((SECONDS - started))

case $rc in
    0) say "PASSED: every test passed (${elapsed} s)" ;;
    5) say "FAILED: pytest collected no tests (exit status 5)"; exit 1 ;;
    1) say "FAILED: some tests failed; see the summary above (${elapsed} s)" ;;
    *) say "FAILED: pytest exit status $rc (interrupted, internal or usage error; ${elapsed} s)" ;;
esac
exit "$rc"
