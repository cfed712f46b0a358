#!/usr/bin/env bash
# Install what lakefs-mount needs on Debian, idempotently, and quickly when it is all there.
#
#   sudo bash packaging/setup.sh
#
# 1. Debian packages (only those missing): fuse3 (fusermount3), libfuse3-dev, pkg-config,
#    gcc and libc6-dev (pyfuse3 is built from source: PyPI has no wheels for it),
#    python3-venv, and python3-dev when the python3 on PATH is Debian's.
# 2. /dev/fuse (loads the fuse module if needed), and pipes of 2 MiB for spliced FUSE I/O
#    (fs.pipe-max-size, raised now and in /etc/sysctl.d/60-lakefs-mount.conf, as root).
# 3. A virtualenv, default /opt/lakefs-mount/venv (override: LAKEFS_MOUNT_VENV), made with
#    the python3 on PATH (3.11 or newer), holding an editable install of this checkout
#    with its test extras: `pip install -e "<repo>[test,frameworks]"`.
# 4. /usr/local/bin/lakefs-mount -> <venv>/bin/lakefs-mount, and the mount(8) helper
#    /sbin/mount.fuse.lakefs-mount -> <venv>/bin/mount.fuse.lakefs-mount (mount(8) looks
#    for helpers in /sbin only), so `mount -t fuse.lakefs-mount` and fstab lines work.
#    LAKEFS_MOUNT_NO_LINKS=1 leaves both alone (packaging/test.sh: a test run installs
#    into a venv of its own and must not re-point the machine's commands at its checkout).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LAKEFS_MOUNT_VENV:-/opt/lakefs-mount/venv}"
BIN_LINK=/usr/local/bin/lakefs-mount
HELPER_LINK=/sbin/mount.fuse.lakefs-mount
MIN_PYTHON=(3 11)

say() { printf 'setup: %s\n' "$*"; }
die() {
    printf 'setup: error: %s\n' "$*" >&2
    exit 1
}
is_root() { [[ $(id -u) -eq 0 ]]; }

installed() {
    # Not `dpkg -s | grep -q`: grep stops at the match, dpkg dies of SIGPIPE, and
    # pipefail turns that into "missing".
    local status
    status="$(dpkg -s "$1" 2>/dev/null)" || return 1
    grep -q '^Status: install ok installed$' <<<"$status"
}

# ------------------------------------------------------------------ Debian packages

python_is_debians() {
    local py
    py="$(command -v python3 || true)"
    [[ -z $py || $(readlink -f "$py") == /usr/bin/* ]]
}

install_debian_packages() {
    command -v dpkg >/dev/null || die "dpkg not found: this installer is for Debian (and derivatives)"
    local wanted=(fuse3 libfuse3-dev pkg-config gcc libc6-dev python3-venv)
    # shellcheck disable=SC2206  # a list of package names: split on blanks
    wanted+=(${LAKEFS_MOUNT_EXTRA_DEBS:-})  # test.sh: what only the tests need
    if python_is_debians; then
        wanted+=(python3-dev)
    fi
    local missing=() pkg
    for pkg in "${wanted[@]}"; do
        installed "$pkg" || missing+=("$pkg")
    done
    if [[ ${#missing[@]} -eq 0 ]]; then
        say "Debian packages present: ${wanted[*]}"
        return
    fi
    is_root || die "missing Debian packages: ${missing[*]}; run this script as root (sudo)"
    say "installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q </dev/null >/dev/null || die "apt-get update failed"
    apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null >/dev/null \
        || die "apt-get install ${missing[*]} failed"
}

# ------------------------------------------------------------------ /dev/fuse

ensure_dev_fuse() {
    if [[ -c /dev/fuse ]]; then
        return
    fi
    if is_root && command -v modprobe >/dev/null; then
        say "/dev/fuse is missing; loading the fuse kernel module"
        modprobe fuse 2>/dev/null || true
    fi
    if [[ -c /dev/fuse ]]; then
        return
    fi
    die "/dev/fuse does not exist and the fuse kernel module could not be loaded \
(modprobe fuse). On a VM or bare metal: install a kernel with FUSE (CONFIG_FUSE_FS) and \
run 'modprobe fuse' as root. In a container: start it with '--device /dev/fuse \
--cap-add SYS_ADMIN' (docker/podman)."
}

PIPE_BYTES=2097152  # a 1 MiB FUSE request or reply and its header, in one pipe
SYSCTL_FILE=/etc/sysctl.d/60-lakefs-mount.conf

ensure_pipe_size() {
    # Spliced write requests (pyfuse3's libfuse) and read replies (the native session)
    # need it when the daemon lacks CAP_SYS_RESOURCE, as root in most containers does.
    local now
    now=$(cat /proc/sys/fs/pipe-max-size 2>/dev/null || echo 0)
    if (( now >= PIPE_BYTES )) || ! is_root; then
        return
    fi
    say "raising fs.pipe-max-size from $now to $PIPE_BYTES (spliced FUSE I/O; $SYSCTL_FILE)"
    if ! printf 'fs.pipe-max-size = %s\n' "$PIPE_BYTES" > "$SYSCTL_FILE" 2>/dev/null \
            || ! echo "$PIPE_BYTES" > /proc/sys/fs/pipe-max-size 2>/dev/null; then
        say "could not raise fs.pipe-max-size: FUSE replies are copied, not spliced \
(lakefs-mount status shows it)"
    fi
}

# ------------------------------------------------------------------ Python and the venv

check_python() {
    local py
    py="$(command -v python3 || true)"
    [[ -n $py ]] || die "no python3 on PATH (Debian: apt-get install python3)"
    if ! python3 -c "import sys; sys.exit(sys.version_info < (${MIN_PYTHON[0]}, ${MIN_PYTHON[1]}))"; then
        die "lakefs-mount needs Python >= ${MIN_PYTHON[0]}.${MIN_PYTHON[1]}, but $py is \
$(python3 -c 'import platform; print(platform.python_version())'); put a newer python3 \
first on PATH (Debian 12 ships 3.11)"
    fi
    if ! python3 -c "import sysconfig, os, sys; \
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
        die "$py has no C headers (Python.h), needed to build pyfuse3; install its \
development files (Debian: apt-get install python3-dev)"
    fi
    say "python: $py ($(python3 -c 'import platform; print(platform.python_version())'))"
}

venv_usable() {
    [[ -x $VENV/bin/python ]] \
        && "$VENV/bin/python" -c "import sys; sys.exit(sys.version_info < (${MIN_PYTHON[0]}, ${MIN_PYTHON[1]}))" \
            2>/dev/null
}

ensure_venv() {
    if venv_usable; then
        return
    fi
    if [[ -e $VENV ]]; then
        [[ -f $VENV/pyvenv.cfg ]] || die "$VENV exists and is not a virtualenv; remove it or \
set LAKEFS_MOUNT_VENV to another path"
        say "recreating the broken or outdated virtualenv $VENV"
        rm -rf -- "$VENV"
    fi
    say "creating virtualenv $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV" || die "python3 -m venv $VENV failed (Debian: apt-get install \
python3-venv)"
}

# True when the venv already runs this checkout with everything the tests need, so a
# rerun skips pip (an editable install picks up code changes by itself; pyproject.toml
# changes are caught by the stamp).
install_current() {
    local stamp="$VENV/.lakefs-mount-installed"
    [[ -f $stamp && $(cat "$stamp") == "$(project_digest)" ]] || return 1
    if ! "$VENV/bin/python" - "$REPO" 2>/dev/null <<'EOF'
import os
import sys

import pyfuse3
import pytest
import pytest_timeout

import lakefs_mount

repo = os.path.realpath(sys.argv[1])
sys.exit(not os.path.realpath(lakefs_mount.__file__).startswith(repo + os.sep))
EOF
    then
        return 1
    fi
    [[ -x $VENV/bin/lakefs-mount && -x $VENV/bin/ruff ]]
}

project_digest() {
    printf '%s %s\n' "$REPO" "$(sha256sum "$REPO/pyproject.toml" | cut -d' ' -f1)"
}

install_project() {
    if install_current; then
        say "lakefs-mount is installed in $VENV (editable, from $REPO)"
        return
    fi
    say "installing lakefs-mount from $REPO into $VENV (pip install -e '.[test,frameworks]')"
    # pip -q still prints errors. The filter drops only the harmless "Location ... is
    # ignored" warnings of index mirrors that lack a package; the exit status is pip's.
    "$VENV/bin/python" -m pip install -q -e "${REPO}[test,frameworks]" </dev/null 2>&1 \
        | sed "/^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$/d" >&2 \
        || die "pip install -e '${REPO}[test,frameworks]' failed (see the messages above)"
    project_digest >"$VENV/.lakefs-mount-installed"
}

# link_command LINK: LINK -> the venv's command of the same name.
link_command() {
    local link="$1"
    local target
    target="$VENV/bin/$(basename "$link")"
    [[ -x $target ]] || die "$target is missing after the install"
    if [[ $(readlink "$link" 2>/dev/null || true) == "$target" ]]; then
        return
    fi
    if ! is_root && [[ ! -w $(dirname "$link") ]]; then
        say "not root: skipping the link $link -> $target (use $target)"
        return
    fi
    ln -sfn "$target" "$link"
    say "linked $link -> $target"
}

main() {
    install_debian_packages
    ensure_dev_fuse
    ensure_pipe_size
    check_python
    ensure_venv
    install_project
    if [[ -z ${LAKEFS_MOUNT_NO_LINKS:-} ]]; then
        link_command "$BIN_LINK"
        link_command "$HELPER_LINK"
    fi
    say "ready: $("$VENV/bin/lakefs-mount" --version) (venv $VENV)"
}

main "$@"
