"""A `lakefs-mount` command on a pseudo-terminal, as a person at a terminal runs it."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import time

from tests.mounting import CLI

READ_SLICE = 0.2  # seconds between checks of the process while nothing is printed


def run_on_terminal(*args: str, interrupt_after: float | None = None,
                    timeout: float = 300) -> tuple[int, str]:
    """Run `lakefs-mount ARGS` with stdout and stderr on a pseudo-terminal until it exits;
    with `interrupt_after`, send it SIGINT (Ctrl-C) after that many seconds. Returns its
    exit status and everything it printed; the process never outlives the call."""
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([CLI, *args], stdin=subprocess.DEVNULL, stdout=terminal,
                            stderr=terminal)
    os.close(terminal)
    started = time.monotonic()
    out = b""
    try:
        while time.monotonic() - started < timeout:
            if interrupt_after is not None and time.monotonic() - started > interrupt_after:
                proc.send_signal(signal.SIGINT)
                interrupt_after = None
            if select.select([controller], [], [], READ_SLICE)[0]:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # EIO: the process closed its side of the terminal
                    chunk = b""
                out += chunk
                if not chunk:
                    break
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=30), out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(controller)
