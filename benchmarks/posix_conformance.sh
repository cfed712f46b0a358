#!/usr/bin/env bash
# POSIX conformance of lakefs-mount: pjdfstest and fsx on a mount over the embedded S3 server.
#
#   posix_conformance.sh LAKEFS_MOUNT_BIN SESSION [PJD_DIR] [FSX_BIN]
#
# SESSION: native | pyfuse3. PJD_DIR: a built pjdfstest checkout; FSX_BIN: a built fsx.
# Either one missing (or not given) is built under $OUT/build from git repositories of
# github.com/pjd/pjdfstest and github.com/kdave/xfstests (PJD_SRC, FSX_SRC: their git dirs;
# Debian packages neither; needs autoconf, automake, gcc).
# Environment: OUT (default: a new /var/tmp/lakefs-posix-SESSION-XXXX), TESTS ("pjd fsx"),
# PJD_TESTS (files or dirs under PJD_DIR/tests; default all), FSX_RUNS (default below),
# KEEP=1 (keep the S3 data and caches for a post-mortem; the mount is still unmounted).
# Runs as root. Mounts with --allow-other --part-size 8M. Everything it starts is under $OUT
# and is stopped on exit, also on failure.
set -euo pipefail
L=$1 SESSION=$2 PJD=${3:-} FSX=${4:-}
OUT=${OUT:-$(mktemp -d "/var/tmp/lakefs-posix-$SESSION-XXXX")}
PJD_SRC=${PJD_SRC:-/work/.mirror/pjd+pjdfstest/repo} FSX_SRC=${FSX_SRC:-/work/.mirror/kdave+xfstests/repo}
TESTS=${TESTS:-pjd fsx}
FSX_RUNS=${FSX_RUNS:-"1:-N 5000|2:-N 5000 -o 1048576|3:-N 20000 -o 1048576"}   # seed:flags
MNT=$OUT/mnt N=0
mkdir -p "$OUT" "$MNT" "$OUT/fsx"

cleanup() {
    kill $(jobs -p) 2>/dev/null || true   # a prove or fsx still running (after a signal)
    if mountpoint -q "$MNT"; then
        timeout 120 "$L" unmount --no-flush "$MNT" || fusermount3 -uz "$MNT" || umount -l "$MNT"
    fi
    sleep 1
    # whatever is still running with our directory in its arguments (daemon, SeaweedFS)
    for p in $(pgrep -f -- "$OUT" || true); do [[ $p != $$ ]] && kill "$p" 2>/dev/null || true; done
    [[ ${KEEP:-0} == 1 ]] || rm -rf "$OUT"/cache* "$OUT"/emb
}
trap cleanup EXIT
trap "exit 130" INT TERM

build() {   # pjdfstest and fsx from the snapshots, as on Debian (autoconf, automake, gcc)
    local b=$OUT/build
    if [[ ! -x $PJD/pjdfstest ]]; then
        PJD=$b/pjdfstest; mkdir -p "$PJD"
        git --git-dir="$PJD_SRC" archive HEAD | tar -x -C "$PJD"
        (cd "$PJD" && autoreconf -ifs && ./configure && make pjdfstest) > "$b/pjd-build.log" 2>&1
    fi
    if [[ ! -x $FSX ]]; then
        local x=$b/xfstests; mkdir -p "$x"
        git --git-dir="$FSX_SRC" archive HEAD | tar -x -C "$x"
        printf '#define HAVE_%s 1\n' SYS_TYPES_H SYS_STAT_H SYS_STATVFS_H SYS_TIME_H SYS_IOCTL_H \
            SYS_WAIT_H MALLOC_H DIRENT_H STDLIB_H UNISTD_H ERRNO_H STRING_H FCNTL_H SYS_PARAM_H \
            LIBGEN_H ASSERT_H STRINGS_H LINUX_FALLOC_H ERR_H > "$b/config.h"
        FSX=$b/fsx
        gcc -O2 -g -D_GNU_SOURCE -DHAVE_COPY_FILE_RANGE -include getopt.h -I"$b" \
            -I"$x/src" -I"$x/include" "$x/ltp/fsx.c" -o "$FSX"
    fi
}

mount_fresh() {   # a new cache dir each time: what the mount then serves comes from S3
    N=$((N + 1))
    "$L" mount "$MNT" --embedded-dir "$OUT/emb" --cache-dir "$OUT/cache$N" \
        --log-file "$OUT/daemon.log" --fuse-session "$SESSION" --allow-other --part-size 8M
}

categorize() {   # failing (non-TODO) pjdfstest assertions: link / pathlen / other
    python3 - "$1" <<'PY'
import re, sys, collections
cur = None; prev_link = False; cats = collections.Counter()
per = collections.defaultdict(collections.Counter); others = []; ok = 0
for line in open(sys.argv[1], errors="replace"):
    line = line.rstrip("\n")
    m = re.match(r"^(/\S+\.t) \.+", line)
    if m:
        cur = m.group(1).split("/tests/")[1]; prev_link = False; continue
    m = re.match(r"^(ok|not ok) (\d+)(.*)", line)
    if not m or cur is None:
        continue
    if m.group(1) == "ok" or "# TODO" in m.group(3):
        ok += 1; continue
    n, rest = m.group(2), m.group(3)
    if cur.startswith("link/"):
        c = "link"
    elif any(len(t) > 1000 for t in rest.split()):
        c = "pathlen"   # a path longer than 1000 chars (PATH_MAX tests)
    elif "tried 'link " in rest or re.search(r"'-u \d+ -g \d+ link ", rest):
        c = "link"
    elif prev_link and (rest == "" or "got ENOENT" in rest or "nlink'" in rest):
        c = "link"      # a check that follows from a refused link (passes in between ignored)
    else:
        c = "other"; others.append(f"  {cur} #{n}{rest[:400]}")
    prev_link = c == "link"; cats[c] += 1; per[c][cur] += 1
print(f"passed or TODO: {ok}; failing: {sum(cats.values())} {dict(cats)}")
for c in ("link", "pathlen", "other"):
    print(f"{c}: {dict(per[c])}")
print("\n".join(others))
PY
}

fsx_run() {   # seed, flags: fsx, then status, flush, a remount on a fresh cache, the sha256 again
    local seed=$1 flags=$2 f=fsx$1.dat rc=0 frc=0 before after st
    (cd "$MNT" && exec "$FSX" $flags -l 33554432 -c 10 -S "$seed" -P "$OUT/fsx" "$f") \
        > "$OUT/fsx/run$seed.log" 2>&1 &   # (in the background: a signal stops the script at once)
    wait $! || rc=$?
    before=$(sha256sum < "$MNT/$f" | cut -c1-64)
    "$L" flush "$MNT" > /dev/null || frc=$?
    st=$("$L" status --json "$MNT" | python3 -c 'import json,sys; d=json.load(sys.stdin)
print(" ".join(f"{k}={d[k]}" for k in ("errors", "retries", "bytes_uploaded", "last_error")))')
    "$L" unmount "$MNT"; mount_fresh
    after=$(sha256sum < "$MNT/$f" | cut -c1-64)
    if [[ -s $OUT/fsx/$f.fsxgood ]]; then   # fsx failed: what S3 holds vs what fsx expected
        st+=" bytes_differing_from_fsxgood=$({ cmp -l "$MNT/$f" "$OUT/fsx/$f.fsxgood" 2>/dev/null || true; } | wc -l)"
    fi
    echo "fsx -S $seed $flags: $([[ $rc == 0 ]] && echo PASS || echo "FAIL(rc=$rc)") $st" \
         "flush_rc=$frc sha_match=$([[ $before == "$after" ]] && echo yes || echo "NO $before $after")" \
         | tee -a "$OUT/fsx-results.txt"
}

build
echo "out: $OUT; lakefs-mount: $("$L" --version); session: $SESSION; pjdfstest: $PJD; fsx: $FSX"
mount_fresh
if [[ " $TESTS " == *" pjd "* ]]; then
    mkdir "$MNT/pjd"
    read -ra t <<< "${PJD_TESTS:-tests}"
    (cd "$MNT/pjd" && exec prove -rv "${t[@]/#/$PJD/}") > "$OUT/pjdfstest.log" 2>&1 &
    wait $! || true
    tail -n 1 "$OUT/pjdfstest.log"
    categorize "$OUT/pjdfstest.log" | tee "$OUT/pjdfstest-categories.txt"
fi
if [[ " $TESTS " == *" fsx "* ]]; then
    "$L" unmount "$MNT"; mount_fresh   # (status counters of fsx runs alone)
    IFS='|' read -ra runs <<< "$FSX_RUNS"
    for r in "${runs[@]}"; do fsx_run "${r%%:*}" "${r#*:}"; done
fi
"$L" unmount "$MNT"
