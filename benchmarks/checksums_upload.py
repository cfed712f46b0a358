"""CPU per GiB of the upload path alone (UploadPart of cache-file parts, in-process), with
no checksum, the CRC-32C in an aws-chunked trailer, and in a header after a first pass.

`python -m benchmarks.checksums_upload [--parts 32] [--rounds 6]`: an embedded SeaweedFS
that checks keys (it takes trailers only from a known one); 8 MiB parts of a file in the
page cache go up with `S3ObjectStore.upload_part` from 4 threads, as the flusher sends
them (`CachePartBody`). Prints this process's CPU seconds per GiB for each mode and round
(modes in rotating order), and the medians of the per-round ratios to "off". The daemon's
whole CPU per GiB written is `benchmarks.checksums`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lakefs_mount.cache.partbody import CachePartBody, UploadSource
from lakefs_mount.s3.embedded import EmbeddedS3
from lakefs_mount.s3.store import S3ObjectStore

PART = 8 * 1024 * 1024
MODES = ("off", "trailer", "header")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    keys = {"access_key": "benchaccesskey", "secret_key": "benchsecretkey0123"}
    os.environ.update(AWS_ACCESS_KEY_ID=keys["access_key"],
                      AWS_SECRET_ACCESS_KEY=keys["secret_key"], AWS_DEFAULT_REGION="us-east-1")
    work = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="checksums-upload-"))
    server = EmbeddedS3(work / "s3", **keys).start(timeout=60)
    data = work / "data"
    data.write_bytes(os.urandom(PART * args.parts))
    fd = os.open(data, os.O_RDONLY)
    try:
        server.create_bucket("bench")
        store = S3ObjectStore("bench", endpoint_url=server.endpoint_url, region="us-east-1",
                              max_attempts=1, **keys)
        source = UploadSource(fd, None)
        gib = PART * args.parts / 1024**3
        rows: list[dict[str, float]] = []
        for r in range(args.rounds):
            row = {}
            for mode in MODES[r % 3:] + MODES[:r % 3]:
                store.trailing_checksums = mode == "trailer"
                upload_id = store.create_multipart("k", {})

                def one(i: int, upload_id: str = upload_id, mode: str = mode) -> str:
                    return store.upload_part("k", upload_id, i + 1,
                                             CachePartBody(source, i * PART, PART),  # type: ignore[arg-type]
                                             mode != "off")

                cpu0 = time.process_time()
                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(one, range(args.parts)))
                row[mode] = (time.process_time() - cpu0) / gib
                store.abort_multipart("k", upload_id)
            rows.append(row)
            print(f"round {r + 1}: " + "; ".join(f"{m} {row[m]:.3f}" for m in MODES)
                  + " CPU s/GiB", flush=True)
        for mode in MODES[1:]:
            ratio = statistics.median(x[mode] / x["off"] for x in rows)
            print(f"median of per-round ratios, {mode} / off: {ratio:.3f}")
    finally:
        os.close(fd)
        server.stop(timeout=3)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
