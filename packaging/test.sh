#!/usr/bin/env bash
# Install what is missing, then lint and run the whole test suite.
#
#   sudo bash packaging/test.sh [extra pytest arguments]
#
# Runs packaging/setup.sh (Debian packages, /dev/fuse, the venv with the test extras),
# then `ruff check .`, `mypy -p lakefs_mount` and `<venv>/bin/python -m pytest -q -ra
# --timeout=600 tests` from the repository root. Exit status 0 only if ruff and mypy are
# clean and every test passed; pytest
# collecting no tests (its exit status 5) is a failure too. CI runs this via .ci/run.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LAKEFS_MOUNT_VENV:-/opt/lakefs-mount/venv}"

say() { printf 'test: %s\n' "$*"; }

# systemd: only its systemd-analyze, for the test that verifies the unit (no systemd runs)
LAKEFS_MOUNT_EXTRA_DEBS="systemd" bash "$REPO/packaging/setup.sh"
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

say "pytest -q -ra --timeout=600 tests $*"
started=$SECONDS
rc=0
"$VENV/bin/python" -m pytest -q -ra --timeout=600 tests "$@" </dev/null || rc=$?
elapsed=$((SECONDS - started))

case $rc in
    0) say "PASSED: every test passed (${elapsed} s)" ;;
    5) say "FAILED: pytest collected no tests (exit status 5)"; exit 1 ;;
    1) say "FAILED: some tests failed; see the summary above (${elapsed} s)" ;;
    *) say "FAILED: pytest exit status $rc (interrupted, internal or usage error; ${elapsed} s)" ;;
esac
exit "$rc"
