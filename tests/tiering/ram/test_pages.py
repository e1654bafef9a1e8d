"""The page table's columns are in memory once it is built: no page of them is left to be faulted
in on the scheduler thread (a first-touched huge page there stalled a store for tens of
milliseconds while the kernel compacted memory). Measured in a fresh interpreter: in a long-lived
one, memory freed earlier may be handed out again already resident."""

from __future__ import annotations

import subprocess
import sys

_MEASURE = """
import os
import numpy as np
from kvci_plugin.tiering.ram.pages import NO_WRITER, PageTable, column

def resident():
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = resident()
{make}
print(resident() - before, sum(c.nbytes for c in columns), int(ok))
"""


def measured(make: str) -> tuple[int, int, bool]:
    """How much resident memory ``make`` (which sets ``columns`` and ``ok``) added, and the bytes
    of its columns."""
    out = subprocess.run([sys.executable, "-c", _MEASURE.format(make=make)], capture_output=True,
                         text=True, check=True).stdout.split()
    return int(out[0]), int(out[1]), out[2] == "1"


def test_a_column_is_resident_when_made() -> None:
    grown, nbytes, ok = measured(
        "col = column(1 << 20, np.int64)\ncolumns = [col]\nok = not col.any()")
    assert ok and grown >= 0.9 * nbytes


def test_every_column_of_a_page_table_is_resident_when_built() -> None:
    grown, nbytes, ok = measured(
        "t = PageTable(1 << 20)\n"
        "columns = [t.v_refs, t.v_pins, t.v_state, t.v_writer, t.v_tenant, t.v_pool, t.taken,"
        " t.kept]\n"
        "ok = (t.v_writer == NO_WRITER).all() and not t.taken.any()")
    assert ok and grown >= 0.9 * nbytes

