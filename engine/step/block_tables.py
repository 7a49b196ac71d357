"""Block tables kept from step to step, so that a decode step does not rebuild hundreds of padded rows."""

from __future__ import annotations

from itertools import repeat

import numpy as np
import torch


class TableStore:
    """Block tables, one row per sequence, on the host and (given a device) mirrored there.

    A row is keyed by the sequence's table list itself: a sequence's list only grows (blocks appended) until
    the sequence is reset, forked, copied on write or its session truncated, each of which gives it a new list
    (sequence.py, scheduler.py, engine_loop.py), so a list seen before needs only its new entries written. The
    store holds every list it keys (so that no id is reused while keyed). A step finds its rows in array
    operations, and writes only those whose list is new or grew (a few: a table grows a block every block_size
    tokens). Once every row is taken, those no call used in this one or the one before are freed together
    (a row the previous step read may still be on its way to the device); the store holds twice the largest
    step, and one more. Row 0 stays zeros, for padded rows, and a row is padded with zeros past its table.
    """

    def __init__(self, rows: int, width: int, device: torch.device | None = None, pin: bool = False) -> None:
        self.host = torch.zeros(rows, width, dtype=torch.long)
        if pin:
            self.host = self.host.pin_memory()
        self._array = self.host.numpy()  # the same memory: a row's entries written without a tensor per write
        self.device = torch.zeros_like(self.host, device=device) if device is not None else None
        self._row_of: dict[int, int] = {}  # id(table) -> its row; row 0 is no table's
        self._tables: list[list[int] | None] = [None] * rows  # each row's list, held so that its id stays its own
        self._written = np.full(rows, -1, dtype=np.int64)  # entries written of each row's table; -1: no table
        self._used = np.zeros(rows, dtype=np.int64)  # the call that last used each row
        self._calls = 0
        self._free = list(range(rows - 1, 0, -1))
        self._dirty: set[int] = set()  # rows written on the host since the last `sync`

    @property
    def width(self) -> int:
        return self.host.shape[1]

    def rows_for(self, tables: list[list[int]]) -> np.ndarray:
        """The store's row of each table, its new entries written to the host copy (`sync` copies them over)."""
        self._calls += 1
        n = len(tables)
        rows = np.fromiter(map(self._row_of.get, map(id, tables), repeat(0)), dtype=np.int64, count=n)
        self._used[rows] = self._calls
        stale = self._written[rows] != np.fromiter(map(len, tables), dtype=np.int64, count=n)
        for i in np.flatnonzero(stale).tolist():
            rows[i] = self._write(tables[i])
        return rows

    def gather(self, tables: list[list[int]]) -> torch.Tensor:
        """The tables as one [rows, longest] int64 host tensor, padded with block 0."""
        rows = self.rows_for(tables)
        self._dirty.clear()  # no device copy to keep current
        width = max(map(len, tables))
        return torch.from_numpy(self._array[rows, :width])

    def sync(self) -> None:
        """The rows written since the last call, copied to the device (a few per step: a sequence's table
        grows by a block every block_size tokens). Only of a store with a device."""
        assert self.device is not None, "a host-only store has nothing to sync"
        for row in self._dirty:
            self.device[row].copy_(self.host[row], non_blocking=True)
        self._dirty.clear()

    def _write(self, table: list[int]) -> int:
        """A table that is new to the store (a fresh row, zeroed), or that grew since written (its new entries);
        one shorter than written (a list cut in place, which the engine never does) starts over."""
        row = self._row_of.get(id(table), 0)
        written = int(self._written[row]) if row else 0
        if not row or written > len(table):
            row = row or self._take_row(table)
            self._array[row] = 0
            written = 0
        self._array[row, written : len(table)] = table[written:]
        self._written[row] = len(table)
        self._used[row] = self._calls
        self._dirty.add(row)
        return row

    def _take_row(self, table: list[int]) -> int:
        if not self._free:
            self._free_stale()
        row = self._free.pop()
        self._row_of[id(table)], self._tables[row] = row, table
        return row

    def _free_stale(self) -> None:
        stale = np.flatnonzero((self._used < self._calls - 1) & (self._written >= 0))
        assert len(stale), "the store holds twice the largest step, and one more"
        for row in stale.tolist():
            table = self._tables[row]
            assert table is not None, "a row with entries written holds its table"
            del self._row_of[id(table)]
            self._tables[row] = None
        self._written[stale] = -1
        self._free += stale.tolist()
