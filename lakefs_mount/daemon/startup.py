"""What a mount proves before its loop starts: the cache directory is its own (locked,
private), the store answers (bucket and credentials, or the embedded server started), the
journal belongs to this bucket, prefix and part size. Failures are one line each.
"""

from __future__ import annotations

import fcntl
import logging
import os
import resource
from contextlib import ExitStack
from pathlib import Path

from lakefs_mount.cache.journal import Journal, JournalDamaged
from lakefs_mount.config import MountConfig, default_embedded_dir
from lakefs_mount.logsetup import register_secret
from lakefs_mount.s3.layout import PartMap
from lakefs_mount.s3.objectstore import ObjectStore, ObjectStoreError

log = logging.getLogger(__name__)

EMBEDDED_BUCKET = "lakefs-mount"
JOURNAL_NAME = "journal.db"
STARTUP_CONNECT_TIMEOUT = 3.0  # seconds per connection attempt of the start-up bucket check
STARTUP_READ_TIMEOUT = 15.0
# Cache files kept open at most: half of the descriptors the rest of the daemon (S3
# connections, the journal, FUSE, the control socket) leaves, within these bounds.
CACHE_FDS_MIN = 16
CACHE_FDS_MAX = 4096
FDS_RESERVED = 256
EMBEDDED_STOP_GRACE = 5.0  # seconds weed gets to exit on SIGTERM before SIGKILL


class StartupError(Exception):
    pass


STARTUP_ERRORS = (StartupError, ObjectStoreError, JournalDamaged, ValueError, OSError)


def prepare(config: MountConfig, stack: ExitStack) -> tuple[ObjectStore, Journal]:
    """The store and the journal of this mount, or StartupError (or one of
    STARTUP_ERRORS) saying why not; what they hold is closed by `stack`."""
    cache_dir = config.resolved_cache_dir()
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(cache_dir, 0o700)
    _lock_cache_dir(cache_dir, stack)
    PartMap(config.part_size)
    store = _open_store(config, stack)
    journal = Journal(cache_dir / JOURNAL_NAME)
    stack.callback(journal.close)
    _check_journal_matches(journal, config)
    return store, journal


def _lock_cache_dir(cache_dir: Path, stack: ExitStack) -> None:
    """One daemon per cache directory: two would upload each other's journal rows."""
    fd = os.open(cache_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    stack.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StartupError(f"cache directory {cache_dir} is in use by another lakefs-mount "
                           "daemon; give this mount its own --cache-dir") from None


def _open_store(config: MountConfig, stack: ExitStack) -> ObjectStore:
    """The store of this mount, proven usable (bucket exists, credentials work) up front."""
    from lakefs_mount.s3.store import S3ObjectStore

    if config.bucket is None:
        from lakefs_mount.s3.embedded import EmbeddedS3, generated_keys

        state = config.embedded_dir or default_embedded_dir()
        state.mkdir(mode=0o700, parents=True, exist_ok=True)
        # A key of its own for every start: only this daemon (and what reads the 0600
        # credentials file) can reach the bucket, and parts go up with a CRC trailer
        server = EmbeddedS3(state, **generated_keys())
        register_secret(server.secret_key)
        server.start()
        # weed's filer stalls ~15 s on SIGTERM; its data is already in the OS by then
        stack.callback(server.stop, EMBEDDED_STOP_GRACE)
        store: ObjectStore = server.store(EMBEDDED_BUCKET, max_attempts=1)  # AsyncStore retries
        server.create_bucket(EMBEDDED_BUCKET)
        config.bucket = EMBEDDED_BUCKET
        config.endpoint_url = server.endpoint_url
        log.info("embedded SeaweedFS serves s3://%s at %s (data in %s)",
                 EMBEDDED_BUCKET, server.endpoint_url, state)
        store.check_bucket()
        return store
    store = S3ObjectStore(config.bucket, endpoint_url=config.endpoint_url,
                          region=config.region, profile=config.profile,
                          max_pool=max(32, config.upload_concurrency * 2),
                          max_attempts=1)  # AsyncStore retries, in the one place (s3/retry)
    # The daemon's requests are retried patiently; the start-up check must fail fast
    # instead, so a wrong address or a dead server is reported within seconds.
    probe = S3ObjectStore(config.bucket, endpoint_url=config.endpoint_url,
                          region=config.region, profile=config.profile, max_pool=1,
                          connect_timeout=STARTUP_CONNECT_TIMEOUT,
                          read_timeout=STARTUP_READ_TIMEOUT, max_attempts=2)
    probe.check_bucket()
    return store


def cache_fd_budget() -> int:
    """Raise the soft descriptor limit to the hard one, as servers commonly do (the soft
    default is often 1,024), and return how many cache file descriptors may stay open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            log.info("descriptor limit stays at %d: %s", soft, exc)
    if soft == resource.RLIM_INFINITY:
        return CACHE_FDS_MAX
    return max(CACHE_FDS_MIN, min(CACHE_FDS_MAX, (soft - FDS_RESERVED) // 2))


def startup_failure(exc: Exception, config: MountConfig) -> str:
    """One line: what failed and what to do. An OSError on a path says so in words, not
    as `[Errno 21] Is a directory: '...'`, and one in the cache directory points at it."""
    if not (isinstance(exc, OSError) and isinstance(exc.filename, str | bytes)
            and exc.strerror):
        return str(exc)
    path = Path(os.fsdecode(exc.filename))
    cache_dir = config.resolved_cache_dir()
    if path == cache_dir or cache_dir in path.parents:
        return (f"cannot use {path}: {exc.strerror}; repair the cache directory "
                f"{cache_dir} or mount with another --cache-dir")
    return f"cannot use {path}: {exc.strerror}"


def _check_journal_matches(journal: Journal, config: MountConfig) -> None:
    """A cache directory belongs to one bucket/prefix/part size; never mix them."""
    identity = {"bucket": config.bucket or "", "prefix": config.prefix,
                "part_size": str(config.part_size)}
    recorded = {k: journal.get_meta(k) for k in identity}
    if all(v is None for v in recorded.values()):
        for k, v in identity.items():
            journal.set_meta(k, v)
        return
    if config.bucket is not None and recorded != identity:
        raise StartupError(
            f"cache directory {config.resolved_cache_dir()} belongs to "
            f"s3://{recorded['bucket']}/{recorded['prefix']} with part size "
            f"{recorded['part_size']}; use another --cache-dir for this mount")
