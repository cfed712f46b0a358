#!/usr/bin/env bash
# Install what lakefs-mount needs on Debian, idempotently, and quickly when it is all there.
#
#   sudo bash packaging/setup.sh [--extras LIST] [--editable]
#
# 1. Debian packages (only those missing): fuse3 (fusermount3), libfuse3-dev, pkg-config,
#    gcc and libc6-dev (pyfuse3 is built from source: PyPI has no wheels for it), and
#    python3, python3-venv and python3-dev (Debian's interpreter, the one preferred below).
# 2. /dev/fuse (loads the fuse module if needed), and pipes of 2 MiB for spliced FUSE I/O
#    (fs.pipe-max-size, raised now and in /etc/sysctl.d/60-lakefs-mount.conf, as root).
# 3. A virtualenv, default /opt/lakefs-mount/venv (override: LAKEFS_MOUNT_VENV), holding
#    this checkout: by default what a mount needs and nothing else (`pip install <repo>`);
#    `--extras embedded` adds the embedded S3 server (quickstart.sh), `--extras
#    test,frameworks --editable` what the tests need, editable (test.sh). The venv is made
#    with an interpreter (3.11 or newer, with its C headers) that every user can run: the
#    first of LAKEFS_MOUNT_PYTHON, /usr/bin/python3 and the python3 on PATH whose files
#    others may read and execute (one under a 0700 home, as /root/.pyenv, is passed over,
#    saying so). It says which interpreter it used.
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
EXTRAS=""     # --extras: comma-separated extras of pyproject.toml
EDITABLE=0    # --editable: pip install -e (the checkout's code runs; tests)
PYTHON=""     # the interpreter the venv is made with (choose_python)

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

install_debian_packages() {
    command -v dpkg >/dev/null || die "dpkg not found: this installer is for Debian (and derivatives)"
    local wanted=(fuse3 libfuse3-dev pkg-config gcc libc6-dev python3 python3-venv python3-dev)
    # shellcheck disable=SC2206  # a list of package names: split on blanks
    wanted+=(${LAKEFS_MOUNT_EXTRA_DEBS:-})  # test.sh: what only the tests need
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

# others_can_use PATH: every directory above PATH lets others in (x), and PATH itself is
# readable and executable (a file) or readable and searchable (a directory) by others.
others_can_use() {
    local path dir
    path="$(readlink -f "$1")" || return 1
    [[ -e $path ]] || return 1
    dir="$(dirname "$path")"
    while [[ $dir != / ]]; do
        [[ $(( 8#$(stat -c %a "$dir") & 1 )) -ne 0 ]] || return 1
        dir="$(dirname "$dir")"
    done
    [[ $(( 8#$(stat -c %a "$path") & 5 )) -eq 5 ]]
}

# python_problem PY: empty if PY can make the venv for every user, else why not.
python_problem() {
    local py="$1" real stdlib
    if ! "$py" -c "import sys; sys.exit(sys.version_info < (${MIN_PYTHON[0]}, ${MIN_PYTHON[1]}))" \
            2>/dev/null; then
        echo "it is not Python ${MIN_PYTHON[0]}.${MIN_PYTHON[1]} or newer"
        return
    fi
    if ! "$py" -c "import sysconfig, os, sys; \
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
        echo "it has no C headers (Python.h) to build pyfuse3 with (Debian: python3-dev)"
        return
    fi
    # a pyenv shim is a script: what runs is sys.executable, with its stdlib
    real="$("$py" -c 'import sys; print(sys.executable)')"
    stdlib="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')"
    if ! others_can_use "$real" || ! others_can_use "$stdlib"; then
        echo "users other than $(id -un) cannot run $real (a directory above it or its \
standard library is closed to them)"
    fi
}

# Sets PYTHON: the first candidate every user can run, else (saying so) the first that
# works at all.
choose_python() {
    local candidates=() py problem fallback=""
    [[ -n ${LAKEFS_MOUNT_PYTHON:-} ]] && candidates+=("$LAKEFS_MOUNT_PYTHON")
    candidates+=(/usr/bin/python3)
    py="$(command -v python3 || true)"
    [[ -n $py ]] && candidates+=("$py")
    for py in "${candidates[@]}"; do
        [[ -x $py ]] || continue
        problem="$(python_problem "$py")"
        if [[ -z $problem ]]; then
            PYTHON="$py"
            say "python: $PYTHON ($("$PYTHON" -c 'import platform; print(platform.python_version())'))"
            return
        fi
        say "not using $py: $problem"
        if [[ -z $fallback && $problem == "users other than"* ]]; then
            fallback="$py"
        fi
    done
    [[ -n $fallback ]] || die "no usable python3 (${candidates[*]}): lakefs-mount needs Python \
>= ${MIN_PYTHON[0]}.${MIN_PYTHON[1]} with its C headers (Debian 12: apt-get install python3 \
python3-dev python3-venv), or name one in LAKEFS_MOUNT_PYTHON"
    PYTHON="$fallback"
    say "python: $PYTHON ($("$PYTHON" -c 'import platform; print(platform.python_version())')); \
only $(id -un) can run the commands of $VENV"
}

# The interpreter directory a venv was made from (pyvenv.cfg's `home`).
venv_home() {
    sed -n 's/^home *= *//p' "$VENV/pyvenv.cfg" 2>/dev/null
}

venv_usable() {
    [[ -x $VENV/bin/python ]] \
        && "$VENV/bin/python" -c "import sys; sys.exit(sys.version_info < (${MIN_PYTHON[0]}, ${MIN_PYTHON[1]}))" \
            2>/dev/null
}

ensure_venv() {
    if venv_usable; then
        local home chosen
        home="$(venv_home)"
        chosen="$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))')"
        if [[ $home == "$chosen" ]]; then
            return
        fi
        if (( EDITABLE )) || others_can_use "$home"; then
            say "keeping $VENV, made with the python of $home$(others_can_use "$home" \
                || echo " (which users other than $(id -un) cannot run)")"
            return
        fi
        # (a test venv is kept as it is: only a runtime one is there for every user)
        say "recreating $VENV: it runs $(venv_home), which users other than $(id -un) \
cannot run"
        rm -rf -- "$VENV"
    fi
    if [[ -e $VENV ]]; then
        [[ -f $VENV/pyvenv.cfg ]] || die "$VENV exists and is not a virtualenv; remove it or \
set LAKEFS_MOUNT_VENV to another path"
        say "recreating the broken or outdated virtualenv $VENV"
        rm -rf -- "$VENV"
    fi
    say "creating virtualenv $VENV with $PYTHON"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV" || die "$PYTHON -m venv $VENV failed (Debian: apt-get install \
python3-venv)"
}

# True when the venv already holds this checkout as asked (the same extras, editable or
# not, and for a copy the same code), so a rerun skips pip. An editable install picks up
# code changes by itself; pyproject.toml changes are caught by the stamp.
install_current() {
    local stamp="$VENV/.lakefs-mount-installed"
    [[ -f $stamp && $(cat "$stamp") == "$(project_digest)" ]] || return 1
    "$VENV/bin/lakefs-mount" --version >/dev/null 2>&1 || return 1
    (( EDITABLE )) || return 0
    "$VENV/bin/python" - "$REPO" 2>/dev/null <<'EOF'
import os
import sys

import lakefs_mount

repo = os.path.realpath(sys.argv[1])
sys.exit(not os.path.realpath(lakefs_mount.__file__).startswith(repo + os.sep))
EOF
}

project_digest() {
    local code=""
    if (( ! EDITABLE )); then  # a copy: any change of the code needs a new install
        code="$(cd "$REPO" && find lakefs_mount/ cache/ cli/ uring/ -name '*.py' -print0 \
            | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)"
    fi
    printf '%s %s editable=%s extras=%s %s\n' "$REPO" \
        "$(sha256sum "$REPO/pyproject.toml" | cut -d' ' -f1)" "$EDITABLE" "$EXTRAS" "$code"
}

install_project() {
    local target="$REPO" how="pip install"
    [[ -n $EXTRAS ]] && target="${REPO}[${EXTRAS}]"
    (( EDITABLE )) && how="pip install -e"
    if install_current; then
        say "lakefs-mount is installed in $VENV ($how '$target')"
        return
    fi
    say "installing lakefs-mount into $VENV ($how '$target')"
    local args=(install -q)
    (( EDITABLE )) && args+=(-e)
    # pip -q still prints errors. The filter drops only the harmless "Location ... is
    # ignored" warnings of index mirrors that lack a package; the exit status is pip's.
    "$VENV/bin/python" -m pip "${args[@]}" "$target" </dev/null 2>&1 \
        | sed "/^WARNING: Location '.*' is ignored: it is neither a file nor a directory\.$/d" >&2 \
        || die "$how '$target' failed (see the messages above)"
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

parse_args() {
    while (( $# )); do
        case $1 in
            --extras) [[ $# -ge 2 ]] || die "--extras needs a list (e.g. test,frameworks)"
                      EXTRAS="$2"; shift ;;
            --extras=*) EXTRAS="${1#--extras=}" ;;
            --editable) EDITABLE=1 ;;
            *) die "unknown argument '$1' (usage: setup.sh [--extras LIST] [--editable])" ;;
        esac
        shift
    done
    [[ $EXTRAS =~ ^[a-z,]*$ ]] || die "--extras '$EXTRAS': a comma-separated list of names"
}

main() {
    parse_args "$@"
    install_debian_packages
    ensure_dev_fuse
    ensure_pipe_size
    choose_python
    ensure_venv
    install_project
    if [[ -z ${LAKEFS_MOUNT_NO_LINKS:-} ]]; then
        link_command "$BIN_LINK"
        link_command "$HELPER_LINK"
    fi
    say "ready: $("$VENV/bin/lakefs-mount" --version) (venv $VENV)"
}

main "$@"
