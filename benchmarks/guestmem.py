"""Keep this VM's memory backed by the host while a benchmark runs.

This kind of VM reports the pages its kernel frees to the host (virtio-balloon free page
reporting, `page_reporting_order` 9), which takes them back. Writing to such a page again
costs a fault on the host: a page-cache write of 1 GiB then took 5-10 s instead of 0.3,
whichever system wrote it. So the first system of a phase to need fresh pages was 3-10 x
slower than the same write a moment later. The DCP save through the mount measured 4 x
local with reporting on and 1.4-1.7 x with it off, the warm torch.load 3.3-3.8 x and
1.0 x (benchmarks/README.md, "Noise").

`kept_backed` raises the reporting order above the largest free block (nothing is
reported), touches the memory available once so that the host backs it, and puts the
order back at the end.
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections.abc import Iterator
from pathlib import Path

ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
NEVER = 11  # above MAX_PAGE_ORDER (10 on x86-64): no free block is ever that large
LEAVE = 3 << 30  # bytes of the available memory not touched


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def kept_backed(notes: list[str], touch: bool = True) -> Iterator[None]:
    """Free page reporting off for the block (root only); what was done goes to `notes`
    (the results' notes), nothing where this kernel has no page reporting."""
    if not ORDER.exists():
        yield
        return
    try:
        before = ORDER.read_text().strip()
        ORDER.write_text(f"{NEVER}\n")
    except OSError as exc:
        notes.append(f"free page reporting to the host left on ({exc}): expect noisy writes")
        yield
        return
    try:
        note = f"free page reporting to the host off during the run (order {before} -> {NEVER})"
        size = max(0, _available() - LEAVE)
        if touch and size:
            began = time.monotonic()
            try:
                with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                               | mmap.MAP_POPULATE):
                    pass
                note += f"; {size >> 30} GiB touched first in {time.monotonic() - began:.0f} s"
            except OSError as exc:
                note += f"; memory not touched first ({exc})"
        notes.append(note)
        yield
    finally:
        with contextlib.suppress(OSError):
            ORDER.write_text(f"{before}\n")
