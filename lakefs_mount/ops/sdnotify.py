"""systemd's readiness protocol (sd_notify) over $NOTIFY_SOCKET, with a plain socket.

Why: a unit of `Type=notify` lets `systemctl start` return, and units ordered after it
start, only once the mount is usable, not when the process has merely begun. The protocol
is one datagram of `KEY=value` lines on the Unix socket named by $NOTIFY_SOCKET, so no
systemd library is needed, and outside systemd (no variable) it does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

ENV = "NOTIFY_SOCKET"


def _address(value: str) -> str | None:
    """$NOTIFY_SOCKET -> a connectable AF_UNIX address ('@name' is the abstract name)."""
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # vsock addresses (VMs) are not spoken here


def notify(**fields: str | int) -> bool:
    """Send `KEY=value` lines (notify(READY=1, STATUS="mounted")); True if one was sent.

    A failure is logged, never raised: systemd missing a message must not break a mount.
    """
    value = os.environ.get(ENV)
    if not value:
        return False
    address = _address(value)
    if address is None:
        log.warning("%s=%s: unsupported address, not notifying systemd", ENV, value)
        return False
    message = "".join(f"{key}={val}\n" for key, val in fields.items()).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message)
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", value, exc)
        return False
    return True
