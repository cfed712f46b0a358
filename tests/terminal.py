"""A `lakefs-mount` command on a pseudo-terminal, as a person at a terminal runs it."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import time
from pathlib import Path

from tests.mounting import CLI

READ_SLICE = 0.2  # seconds between checks of the process while nothing is printed


def _as_a_shell_starts_a_job() -> None:
    """Ctrl-C's default in the child, as a shell gives its foreground jobs: one ignored
    in this process (conftest._ctrl_c_as_it_was says how that came about) passes on
    through exec, and Python then installs no KeyboardInterrupt at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _where_it_waits(pid: int) -> str:
    """What a process that outlived its Ctrl-C is doing, for the failure's message."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as exc:
        return f"(no /proc view: {exc})"
    fields = {k: v.strip() for k, _, v in (line.partition(":") for line in status.splitlines())}
    return (f"state {fields.get('State')}, waiting in {wchan or '-'}, "
            f"ignored signals {fields.get('SigIgn')}, caught {fields.get('SigCgt')}")


def run_on_terminal(*args: str, interrupt_after: float | None = None,
                    timeout: float = 300) -> tuple[int, str]:
    """Run `lakefs-mount ARGS` with stdout and stderr on a pseudo-terminal until it exits;
    with `interrupt_after`, send it SIGINT (Ctrl-C) after that many seconds. Returns its
    exit status and everything it printed; the process never outlives the call."""
    controller, terminal = pty.openpty()
    proc = subprocess.Popen([CLI, *args], stdin=subprocess.DEVNULL, stdout=terminal,
                            stderr=terminal, preexec_fn=_as_a_shell_starts_a_job)
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
        try:
            return proc.wait(timeout=30), out.decode(errors="replace")
        except subprocess.TimeoutExpired:
            raise AssertionError(f"`lakefs-mount {' '.join(args)}` still runs after "
                                 f"{time.monotonic() - started:.0f} s: "
                                 f"{_where_it_waits(proc.pid)}; it printed: "
                                 f"{out.decode(errors='replace')[-2000:]}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(controller)
