"""Keep this VM's memory backed by the host while a benchmark runs.

This kind of VM reports the pages its kernel frees to the host (virtio-balloon free page
reporting, `page_reporting_order` 9), which takes them back. Writing to such a page again
costs a fault on the host: a page-cache write of 1 GiB then took 5-10 s instead of 0.3,
whichever system wrote it. So the first system of a phase to need fresh pages was 3-10 x
slower than the same write a moment later. The DCP save through the mount measured 4 x
local with reporting on and 1.4-1.7 x with it off, the warm torch.load 3.3-3.8 x and
1.0 x (benchmarks/README.md, "Noise").

Two ways to keep it backed, chosen by the entry points' flags (`add_arguments`):

- By default nothing on the machine is changed: `Backing.before_point` touches, right
  before each timed point, as much memory as the point will use (twice its data, within
  the memory available; `--touch-gib` sets it) and frees it again. The kernel reports
  free blocks only some time after they were freed (a delay of about 2 s), so the point's
  page cache and buffers start on pages the host backs.
- `--set-page-reporting-order` (root): `kept_backed` raises the reporting order above the
  largest free block for the run (nothing is reported), touches the memory available once
  so that the host backs it, and puts the order back at the end. The recorded results of
  2026-12-04 on were taken this way (their notes say so).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import time
from collections.abc import Iterator
from pathlib import Path

ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
NEVER = 11  # above MAX_PAGE_ORDER (10 on x86-64): no free block is ever that large
LEAVE = 3 << 30  # bytes of the available memory not touched
GiB = 1 << 30
PER_POINT = 2  # touched before a point, x its data: its pages in the page cache and a copy


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def touch(size: int) -> None:
    """Map `size` bytes of private anonymous memory with every page written (MAP_POPULATE
    on a writable private mapping faults each page in for writing), then unmap it."""
    with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE):
        pass


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The memory flags every entry point that times points takes."""
    ap.add_argument("--set-page-reporting-order", action="store_true",
                    help="root: raise the kernel's page_reporting_order for the run so that "
                         "this VM reports no freed memory to its host, touch the available "
                         "memory once, and put the order back at the end (default: the "
                         "setting is left alone and memory is touched before each point)")
    ap.add_argument("--touch-gib", type=float,
                    help="GiB of memory touched before each timed point (default: twice the "
                         "point's data where the kernel reports free pages, unless --quick "
                         "or --set-page-reporting-order; 0: never)")


@contextlib.contextmanager
def kept_backed(notes: list[str], touch_first: bool = True) -> Iterator[None]:
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
        if touch_first and size:
            began = time.monotonic()
            try:
                touch(size)
                note += f"; {size >> 30} GiB touched first in {time.monotonic() - began:.0f} s"
            except OSError as exc:
                note += f"; memory not touched first ({exc})"
        notes.append(note)
        yield
    finally:
        with contextlib.suppress(OSError):
            ORDER.write_text(f"{before}\n")


class Backing:
    """What a benchmark run does about the VM's memory (see the module's docstring); its
    notes go to `notes`. `held()` wraps the run; `before_point(nbytes)` starts each timed
    point whose data is `nbytes`."""

    def __init__(self, notes: list[str], *, set_order: bool = False,
                 touch_gib: float | None = None, quick: bool = False) -> None:
        self.notes = notes
        self.set_order = set_order
        self.quick = quick
        self.order = ORDER.read_text().strip() if ORDER.exists() else None
        # bytes per point (None: PER_POINT x the point's data), or 0: no touching
        self.fixed: int | None = int(touch_gib * GiB) if touch_gib is not None else None
        if self.fixed is None and (self.order is None or set_order or quick):
            self.fixed = 0  # nothing reports freed pages, or --quick keeps it short
        self.raised = False  # the order raised for the run (--set-page-reporting-order)
        self.points = 0
        self.touched = 0
        self.seconds = 0.0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        try:
            if self.set_order:
                with kept_backed(self.notes, touch_first=not self.quick):
                    self.raised = ORDER.exists() and ORDER.read_text().strip() == str(NEVER)
                    yield
            else:
                yield
        finally:
            self.notes.append(self.summary())

    def before_point(self, nbytes: int) -> None:
        size = (PER_POINT * nbytes if self.fixed is None else self.fixed)
        size = min(size, max(0, _available() - LEAVE))
        if size <= 0:
            return
        began = time.monotonic()
        try:
            touch(size)
        except OSError as exc:
            self.fixed = 0
            self.notes.append(f"memory touching before the points stopped ({exc})")
            return
        self.seconds += time.monotonic() - began
        self.points += 1
        self.touched += size

    def summary(self) -> str:
        order = ("off for the run (--set-page-reporting-order)" if self.raised
                 else f"left on (order {self.order})" if self.order is not None
                 else "not present on this kernel")
        if self.points:
            return (f"free page reporting to the host {order}; memory touched before each "
                    f"timed point: {self.points} points, {self.touched / GiB:.1f} GiB in "
                    f"{self.seconds:.0f} s in all")
        why = " (--quick)" if self.quick and not self.set_order else ""
        return f"free page reporting to the host {order}; memory not touched before the " \
               f"points{why}"
