"""Logging for the CLI and the daemon, with credentials scrubbed from every line.

Why a redacting filter: botocore at DEBUG, exception messages and config dumps can all
carry access keys or signatures, and log files get pasted into bug reports.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import re
import sys
import time
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FORMATS = ("text", "json")
MASK = "***"
SECRET_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_NOISY = ("botocore", "boto3", "s3transfer", "urllib3")
LOG_MAX_BYTES = 16 * 1024 * 1024  # a mount runs for weeks: its logs rotate at this size
LOG_KEEP = 4  # older files kept: log.1 (newest) ... log.4

_KEY_NAMES = (r"aws_secret_access_key|aws_access_key_id|aws_session_token|"
              r"secret_access_key|secretaccesskey|access_key_id|accesskeyid|"
              r"secret_key|access_key|session_token|sessiontoken|password|"
              r"x-amz-security-token|x-amz-credential|x-amz-signature|credential|signature")
_PATTERNS = [
    # key = value, key: value, 'key': 'value', KEY="value", Credential=AKIA.../...
    re.compile(r"(?i)(\b(?:" + _KEY_NAMES + r")['\"]?\s*[=:]\s*['\"]?)([^\s'\",;&}]+)"),
    # access key ids: AKIA / ASIA + 16 upper-case alphanumerics
    re.compile(r"()\b((?:AKIA|ASIA|AROA|AIDA)[A-Z0-9]{16})\b"),
]
# 40-character AWS secret keys standing alone; demanding mixed case and a digit keeps
# hex digests (lower-case only) and ordinary words out.
_SECRET40 = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")

_extra_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """Scrub this literal value from all future log lines (e.g. embedded-server keys)."""
    if value and len(value) >= 4:
        _extra_secrets.add(value)


def _looks_like_secret(s: str) -> bool:
    return (any(c.isupper() for c in s) and any(c.islower() for c in s)
            and any(c.isdigit() for c in s))


def redact(text: str) -> str:
    """`text` with every credential-looking value replaced by ***."""
    literals = set(_extra_secrets)
    for name in SECRET_ENV_VARS:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            literals.add(value)
    for literal in sorted(literals, key=len, reverse=True):
        text = text.replace(literal, MASK)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + MASK, text)
    return _SECRET40.sub(lambda m: MASK if _looks_like_secret(m.group(0)) else m.group(0), text)


class RedactingFilter(logging.Filter):
    """Rewrites each record's message (and traceback text) with `redact`; never drops one."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken %-format must not lose the line
            message = f"{record.msg!r} {record.args!r}"
        clean = redact(message)
        if clean != message or record.args:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


# What every LogRecord has; anything else on a record came from `extra=` and is a field.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers: time (UTC, ISO 8601), level, logger,
    message, the traceback if any, and the fields a caller passed with `extra=`.

    Runs after RedactingFilter, which has scrubbed the message and traceback; string
    fields from `extra=` are scrubbed here."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                entry[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exception"] = record.exc_text
        return json.dumps(entry, default=str)


def open_log_file(log_file: Path) -> None:
    """Create the log file (and its directory) private to the owner: 0600 in 0700."""
    log_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def rotate_log(path: Path, keep: int = LOG_KEEP) -> None:
    """Shift `path` to `path.1`, `path.1` to `path.2` and so on; the oldest is dropped.
    The files keep their private mode: they are renamed, never copied."""
    for i in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    if path.exists():
        os.replace(path, path.with_name(f"{path.name}.1"))


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A log file that rotates at LOG_MAX_BYTES, every file 0600.

    With `own_stdio` (the daemon, whose stdout and stderr are its log file), a rotation
    points file descriptors 1 and 2 at the new file too, so a traceback printed by the
    interpreter lands next to the log lines instead of in a rotated file."""

    def __init__(self, log_file: Path, own_stdio: bool) -> None:
        open_log_file(log_file)
        super().__init__(log_file, maxBytes=LOG_MAX_BYTES, backupCount=LOG_KEEP,
                         encoding="utf-8")
        self._own_stdio = own_stdio

    def doRollover(self) -> None:  # noqa: N802 - logging's name
        if self.stream:
            self.stream.close()
            self.stream = None  # type: ignore[assignment]
        log_file = Path(self.baseFilename)
        rotate_log(log_file, self.backupCount)
        open_log_file(log_file)
        self.stream = self._open()
        if self._own_stdio:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.dup2(self.stream.fileno(), 1)
            os.dup2(self.stream.fileno(), 2)


def setup_logging(level: str, log_file: Path | None, foreground: bool,
                  own_stdio: bool = False, log_format: str = "text") -> None:
    """Configure the root logger: stderr when in the foreground, plus `log_file` if given
    (rotated, see PrivateRotatingFileHandler; `own_stdio`: this process's stdout and
    stderr are that file), lines as text or as JSON (`log_format`).

    Calling it again replaces the handlers it installed before.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_lakefs_mount", False):
            root.removeHandler(handler)
            handler.close()
    handlers: list[logging.Handler] = []
    if foreground:
        handlers.append(logging.StreamHandler(sys.stderr))
    if log_file is not None:
        handlers.append(PrivateRotatingFileHandler(log_file, own_stdio))
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(FORMAT)
    for handler in handlers:
        handler.setFormatter(formatter)
        handler.addFilter(RedactingFilter())
        handler._lakefs_mount = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(numeric)
    # botocore at DEBUG dumps every signed request; only an explicit opt-in turns it on.
    wire_debug = os.environ.get("LAKEFS_MOUNT_DEBUG_BOTO") == "1"
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.DEBUG if wire_debug else logging.WARNING)
    logging.captureWarnings(True)
