"""Block tables kept from step to step, so that a decode step does not rebuild hundreds of padded rows."""

from __future__ import annotations

import operator
from itertools import repeat

import numpy as np
import torch


class TableStore:
    """Block tables, one row per sequence, on the host and mirrored on a device: what CUDA graphs read by row.

    A row is keyed by the sequence's table list itself: a sequence's list only grows (blocks appended) until
    the sequence is reset, forked, copied on write or its session truncated, each of which gives it a new list
    (sequence.py, scheduler.py, engine_loop.py), so a list seen before needs only its new entries written. The
    store holds every list it keys (so that no id is reused while keyed). A step finds its rows in array
    operations, and writes only those whose list is new or grew (a few: a table grows a block every block_size
    tokens). Once every row is taken, those no call used in this one or the one before are freed together
    (a row the previous step read may still be on its way to the device); the store holds twice the largest
    step, and one more. Row 0 stays zeros, for padded rows, and a row is padded with zeros past its table.
    """

    def __init__(self, rows: int, width: int, device: torch.device, pin: bool = False) -> None:
        self.host = torch.zeros(rows, width, dtype=torch.long)
        self._array = self.host.numpy()  # the same memory: a row's entries written without a tensor per write
        self.device = torch.zeros_like(self.host, device=device)
        # What `sync` sends, flat: the written rows' numbers, then their entries. Two on the host, taken in turn
        # (the copy of one may still be queued while the next step syncs), pinned for a copy that does not wait.
        self._stages = [torch.zeros(rows * (width + 1), dtype=torch.long) for _ in range(2)]
        if pin:
            self._stages = [stage.pin_memory() for stage in self._stages]
        self._stage_device = torch.zeros_like(self._stages[0], device=device)
        self._row_of: dict[int, int] = {}  # id(table) -> its row; row 0 is no table's
        self._tables: list[list[int] | None] = [None] * rows  # each row's list, held so that its id stays its own
        self._written = np.full(rows, -1, dtype=np.int64)  # entries written of each row's table; -1: no table
        self._used = np.zeros(rows, dtype=np.int64)  # the call that last used each row
        self._calls = 0
        self._free = list(range(rows - 1, 0, -1))
        self._dirty: set[int] = set()  # rows written on the host since the last `sync`
        # The last call's list of tables (held as given: no id reused meanwhile) and their rows
        self._last: tuple[list[list[int]] | None, np.ndarray] = (None, np.zeros(0, dtype=np.int64))

    @property
    def width(self) -> int:
        return self.host.shape[1]

    def rows_for(self, tables: list[list[int]], growth: list[tuple[int, int, int]] | None = None) -> np.ndarray:
        """The store's row of each table, its new entries written to the host copy (`sync` copies them over).
        `growth`: where `tables` is the list the last call was given (the same object), of which those in
        `growth` (index, entry, block) gained one block each since, at that entry (a followed step:
        `StepPlan.table_growth`): the last call's rows, with only those entries written. The array returned is
        the caller's to read, not to change."""
        self._calls += 1
        held, rows = self._last
        if growth is not None and tables is held and all(self._written[rows[i]] == at for i, at, _ in growth):
            self._used[rows] = self._calls
            for i, at, block in growth:
                row = int(rows[i])
                self._array[row, at] = block
                self._written[row] = at + 1
                self._dirty.add(row)
        else:
            n = len(tables)
            rows = np.fromiter(map(self._row_of.get, map(id, tables), repeat(0)), dtype=np.int64, count=n)
            self._used[rows] = self._calls  # before any row is taken: a full store frees the rows not used
            stale = self._written[rows] != np.fromiter(map(len, tables), dtype=np.int64, count=n)
            for i in np.flatnonzero(stale).tolist():
                rows[i] = self._write(tables[i])
            self._last = (tables, rows)
        return rows

    def passed_by(self) -> None:
        """A step that ran without the store: the next call finds its rows by the tables' ids, since a followed
        step's growth names only the blocks gained since the step before it."""
        self._last = (None, self._last[1])

    def sync(self) -> None:
        """The rows written since the last call (a few per step: a sequence's table grows by a block every
        block_size tokens) onto the device: one copy and one scatter however many, since each CUDA call costs
        the host more than a row's bytes cost the bus."""
        if not self._dirty:
            return
        rows = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
        self._dirty.clear()
        k, width = len(rows), self.width
        self._stages.reverse()
        stage = self._stages[0].numpy()
        stage[:k] = rows
        np.take(self._array, rows, axis=0, out=stage[k : k + k * width].reshape(k, width))
        sent = self._stage_device[: k + k * width]
        sent.copy_(self._stages[0][: k + k * width], non_blocking=True)
        self.device.index_copy_(0, sent[:k], sent[k:].view(k, width))

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


class StepTables:
    """The decodes' block tables in step order, as one contiguous [rows, width] array kept across steps.

    A steady decode step runs the same sequences in the same order as the step before, each table the same
    list or grown by a block: its array is last step's with a few entries appended, rather than every row
    copied out of a store again (a copy whose source a CPU forward has evicted from the caches).
    Rows are keyed by position: a position whose list is the one it held last step (the same object: the lists
    of the last step are held, so none is freed and its address reused meanwhile) keeps its row and has its new
    entries written. The caller passes a new list of the tables each step (a plan's): the one of the last step
    is held as it was given, not copied. Where the
    batch changed (a sequence joined, left or moved), the rows are taken from their old positions into the
    other of two arrays in one copy, and only tables new to the array are written whole. Rows are zeros past
    their table; the width follows the longest table, in steps of WIDTH_STEP blocks, so that it changes
    rarely and pads little.
    """

    WIDTH_STEP = 8

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._arrays = [np.zeros((rows, 0), dtype=np.int64)] * 2  # the current one first
        self._held: list[list[int]] = []  # last step's tables, in order
        self._lens = np.zeros(0, dtype=np.int64)

    def tables(self, tables: list[list[int]]) -> torch.Tensor:
        """[len(tables), width] int64, row i table i zero-padded: a view of the kept array, valid until the next
        call (a device copies it at once: `to_device` stages it in pinned memory)."""
        n = len(tables)
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
        self._fit(n, int(lens.max()))
        array = self._arrays[0]
        # The same lists in the same places: compared in one C pass over the two lists' pointers
        if n <= len(self._held) and all(map(operator.is_, tables, self._held)):
            grown = np.flatnonzero(lens != self._lens[:n])
            written = self._lens[grown]
            if (lens[grown] == written + 1).all():  # a block each (most steps: a few rows, or none)
                array[grown, written] = [tables[i][-1] for i in grown.tolist()]
            else:
                for i in grown.tolist():
                    self._write(array, i, tables[i], int(self._lens[i]))
        else:
            array = self._moved(tables, lens)
        self._held, self._lens = tables, lens
        return torch.from_numpy(array[:n])

    def grown(self, tables: list[list[int]], growth: list[tuple[int, int, int]]) -> torch.Tensor:
        """`tables` as `tables` returns them, where the caller knows what changed since the last call: the same
        lists (the one the last call was given), of which those in `growth` (row, entry, block) gained one block
        each, at that entry. Written in place, without a look at the other lists; as `tables` where it is not
        so."""
        array, lens = self._arrays[0], self._lens
        width = array.shape[1]
        if tables is not self._held or any(lens[row] != at or at >= width for row, at, _ in growth):
            return self.tables(tables)
        for row, at, block in growth:
            array[row, at] = block
            lens[row] = at + 1
        return torch.from_numpy(array[: len(tables)])

    def _moved(self, tables: list[list[int]], lens: np.ndarray) -> np.ndarray:
        """The step's rows in the other array: each from where its list was last step (one copy), or written."""
        old, new = self._arrays
        where = {id(table): i for i, table in enumerate(self._held)}
        src = np.fromiter(map(where.get, map(id, tables), repeat(-1)), dtype=np.int64, count=len(tables))
        known = src >= 0
        np.take(old, np.where(known, src, 0), axis=0, out=new[: len(tables)])
        written = np.zeros_like(lens)  # entries of each row that came with it
        written[known] = self._lens[src[known]]
        for i in np.flatnonzero(lens != written).tolist():
            self._write(new, i, tables[i], int(written[i]))
        self._arrays = [new, old]
        return new

    @staticmethod
    def _write(array: np.ndarray, row: int, table: list[int], written: int) -> None:
        """A row's new entries; a row written whole (from `written` 0) or cut shorter is zeroed past its table."""
        if written == 0 or written > len(table):
            array[row] = 0
            written = 0
        array[row, written : len(table)] = table[written:]

    def _fit(self, n: int, needed: int) -> None:
        """Arrays for a step of `n` rows whose longest table is `needed` blocks: a width grown past it, or shrunk
        where it pads two width steps more than it must (more rows, should a step ever bring them); then every
        row is written again."""
        width = self._arrays[0].shape[1]
        if n <= self.rows and needed <= width < needed + 2 * self.WIDTH_STEP:
            return
        self.rows, width = max(self.rows, n), -(-needed // self.WIDTH_STEP) * self.WIDTH_STEP
        self._arrays = [np.zeros((self.rows, width), dtype=np.int64) for _ in range(2)]
        self._held, self._lens = [], np.zeros(0, dtype=np.int64)
