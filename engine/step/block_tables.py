"""Block tables kept from step to step, so that a decode step does not rebuild hundreds of padded rows."""

from __future__ import annotations

from collections import OrderedDict

import torch


class TableStore:
    """Block tables, one row per sequence, on the host and (given a device) mirrored there.

    A row is keyed by the sequence's table list itself: a sequence's list only grows (blocks appended) until
    the sequence is reset, forked, copied on write or its session truncated, each of which gives it a new list
    (sequence.py, scheduler.py, engine_loop.py), so a list seen before needs only its new entries written. The
    store holds every list it keys (so that no id is reused while keyed) and recycles the least recently used
    rows; row 0 stays zeros, for padded rows, and a row is padded with zeros past its table.
    """

    def __init__(self, rows: int, width: int, device: torch.device | None = None, pin: bool = False) -> None:
        self.host = torch.zeros(rows, width, dtype=torch.long)
        if pin:
            self.host = self.host.pin_memory()
        self._array = self.host.numpy()  # the same memory: a row's entries written without a tensor per write
        self.device = torch.zeros_like(self.host, device=device) if device is not None else None
        self._rows: OrderedDict[int, tuple[list[int], int, int]] = OrderedDict()  # id -> (table, row, entries written)
        self._free = list(range(rows - 1, 0, -1))
        self._dirty: set[int] = set()  # rows written on the host since the last `sync`

    @property
    def width(self) -> int:
        return self.host.shape[1]

    def rows_for(self, tables: list[list[int]]) -> list[int]:
        """The store's row of each table, its new entries written to the host copy (`sync` copies them over)."""
        rows, keyed, array = [], self._rows, self._array
        for table in tables:
            known = keyed.pop(id(table), None)
            n = len(table)
            if known is None or known[2] > n:
                row, written = self._take_row() if known is None else known[1], 0
                array[row] = 0
                self._dirty.add(row)
            else:
                row, written = known[1], known[2]
            if n > written:
                array[row, written:n] = table[written:]
                self._dirty.add(row)
            keyed[id(table)] = (table, row, n)  # most recently used last
            rows.append(row)
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

    def _take_row(self) -> int:
        """A free row, else the least recently used one (never one of this step's: the store holds twice the
        largest step)."""
        if self._free:
            return self._free.pop()
        _, (_, row, _) = self._rows.popitem(last=False)
        return row
