"""The page table's columns are in memory once it is built: no page of them is left to be faulted
in on the scheduler thread (a first-touched huge page there stalled a store for tens of
milliseconds while the kernel compacted memory)."""

from __future__ import annotations

import os

import numpy as np

from kvci_plugin.tiering.ram.pages import NO_WRITER, PageTable, column

SLOTS = 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_column_is_resident_when_made() -> None:
    before = resident_bytes()
    col = column(SLOTS, np.int64)
    assert resident_bytes() - before >= 0.9 * col.nbytes
    assert not col.any()


def test_every_column_of_a_page_table_is_resident_when_built() -> None:
    before = resident_bytes()
    table = PageTable(SLOTS)
    columns = [table.v_refs, table.v_pins, table.v_state, table.v_writer, table.v_tenant,
               table.v_pool, table.released, table.kept]
    assert resident_bytes() - before >= 0.9 * sum(c.nbytes for c in columns)
    assert (table.v_writer == NO_WRITER).all() and not table.released.any()
