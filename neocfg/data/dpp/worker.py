"""A stateless DPP worker: read one split's projected columns, transform, batch, hand the result back.

Workers hold no progress: the master tells each what to do next, one split at a time, and a worker that dies loses
nothing but the split it was on (the master requeues it). The process imports no torch, so it starts fast; the
client wraps the arrays as tensors without copying.

Wire protocol over the worker's own pipe (messages are whole pickles, so a worker killed mid-send leaves a short
message that the master's recv reports as an error, never a half-read result):
  worker -> master: (Msg.ready, worker_id), (Msg.result, SplitResult), (Msg.error, Task, message)
  master -> worker: a Task, or None to stop
"""

from __future__ import annotations

import io
import os
import signal
import time
from dataclasses import dataclass, field
from enum import Enum
from multiprocessing.connection import Connection
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from neocfg.data.arrays import BatchArrays
from neocfg.data.dataset import FeatureColumns, Split, open_location
from neocfg.data.dpp.progress import SplitMeta, Task
from neocfg.data.transforms import BoundTransform, apply, from_arrow, to_batch_arrays
from neocfg.errors import DataError

# How often an idle worker checks that its master's process still exists (seconds).
PARENT_CHECK_S = 1.0


class Msg(Enum):
    """Kinds of worker -> master messages."""

    ready = "ready"
    result = "result"
    error = "error"


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, picklable: columns to read, transforms, batch size."""

    columns: FeatureColumns
    transforms: tuple[BoundTransform, ...]
    batch_size: int
    # Read only the model's columns (the DPP default); False reads every column (the benchmark's baseline).
    project: bool = True
    # Simulated extra preprocessing time per split, seconds (benchmarks and fault tests; 0 in real runs).
    extra_split_s: float = 0.0


@dataclass
class Piece:
    """Rows [start, start + arrays.rows) of a split (numbered after the transforms)."""

    start: int
    arrays: BatchArrays


@dataclass
class SplitResult:
    task: Task
    rows: int                 # rows of the split after the transforms (before `keep`)
    pieces: list[Piece]       # full batches of batch_size rows, then one shorter tail per kept range
    bytes_read: int
    seconds: float
    skipped: Optional[str] = None  # the error, when the split was skipped (dsi.on_bad_split=skip)
    rows_read: int = 0             # rows before the transforms
    dropped: tuple[tuple[int, str, int], ...] = ()  # (transform index, description, rows) per filter
    # Set by the master as it hands the split out: epochs below this are complete job-wide (the client prunes).
    complete_below: int = 0
    ids_cut: int = 0                                 # ids the truncate transforms removed
    delivered_rows: int = field(init=False)

    def __post_init__(self) -> None:
        self.delivered_rows = sum(p.arrays.rows for p in self.pieces)

    def meta(self) -> SplitMeta:
        return SplitMeta(task=self.task, rows=self.rows, delivered_rows=self.delivered_rows,
                         bytes_read=self.bytes_read, seconds=self.seconds, rows_read=self.rows_read,
                         dropped=self.dropped, skipped=self.skipped, ids_cut=self.ids_cut)

    @staticmethod
    def skipped_split(meta: SplitMeta) -> "SplitResult":
        return SplitResult(task=meta.task, rows=0, pieces=[], bytes_read=0, seconds=0.0, skipped=meta.skipped)


class _CountingFile(io.RawIOBase):
    """A file of any pyarrow filesystem that counts the bytes pyarrow actually reads from it (the footer and the
    projected column chunks)."""

    def __init__(self, raw: pa.NativeFile) -> None:
        super().__init__()
        self.raw = raw
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read() if size is None or size < 0 else self.raw.read(size)
        self.bytes_read += len(data)
        return data

    def readinto(self, buffer) -> int:  # type: ignore[override]
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self.raw.close()
        super().close()


class SplitReader:
    """Reads and preprocesses splits; keeps each file open (footer read once) across splits."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self._files: dict[str, tuple[_CountingFile, pq.ParquetFile]] = {}

    def _open(self, split: Split) -> tuple[_CountingFile, pq.ParquetFile]:
        if split.path not in self._files:
            try:
                fs, inner = open_location(split.path)
                f = _CountingFile(fs.open_input_file(inner))
            except FileNotFoundError:
                raise DataError(f"{split.where}: file not found") from None
            except (OSError, pa.ArrowException) as exc:
                raise DataError(f"{split.where}: cannot open ({_first_line(exc)})") from None
            try:
                self._files[split.path] = (f, pq.ParquetFile(f))
            except (pa.ArrowException, OSError) as exc:
                f.close()
                raise DataError(f"{split.where}: not a readable Parquet file ({_first_line(exc)})") from None
        return self._files[split.path]

    def read(self, split: Split) -> tuple[pa.Table, int]:
        f, pf = self._open(split)
        before = f.bytes_read
        if split.row_group >= pf.num_row_groups:
            raise DataError(f"{split.where}: the file has only {pf.num_row_groups} row groups")
        columns = self.spec.columns.read_columns(pf.schema_arrow.names) if self.spec.project else None
        if columns is not None:
            missing = [c for c in columns if c not in pf.schema_arrow.names]
            if missing:
                raise DataError(f"{split.where}: column {missing[0]!r} is missing (the model needs it); the file's"
                                f" schema does not match the model")
        try:
            table = pf.read_row_group(split.row_group, columns=columns, use_threads=False)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{split.where}: cannot read ({_first_line(exc)})") from None
        return self.spec.columns.renamed(table), f.bytes_read - before

    def process(self, task: Task) -> SplitResult:
        t0 = time.perf_counter()
        split = task.split
        table, nbytes = self.read(split)
        if table.num_rows != split.rows:
            raise DataError(f"{split.where}: has {table.num_rows} rows, the manifest says {split.rows}")
        dropped: dict[int, int] = {}
        cut: dict[int, int] = {}
        rows = apply(from_arrow(table, self.spec.columns, split.where, split.first_row), list(self.spec.transforms),
                     dropped, cut)
        arrays = to_batch_arrays(rows, self.spec.columns, split.where)
        if self.spec.extra_split_s:
            time.sleep(self.spec.extra_split_s)
        pieces = []
        for a, b in task.keep or ((0, arrays.rows),):
            kept = arrays.slice(a, b)
            for k, part in enumerate(kept.split_batches(self.spec.batch_size)):
                pieces.append(Piece(start=a + k * self.spec.batch_size, arrays=part))
        names = {t.index: t.describe for t in self.spec.transforms}
        return SplitResult(task=task, rows=arrays.rows, pieces=pieces, bytes_read=nbytes,
                           seconds=time.perf_counter() - t0, rows_read=table.num_rows,
                           dropped=tuple((i, names[i], n) for i, n in sorted(dropped.items()) if n),
                           ids_cut=sum(cut.values()))

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files.clear()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def worker_main(conn: Connection, spec: WorkerSpec, worker_id: int, parent_pid: int) -> None:
    """Entry point of a worker process. Exits when told to, when its pipe closes, or when its master is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it then stops us
    reader = SplitReader(spec)
    orphaned = False
    try:
        conn.send((Msg.ready, worker_id))
        while True:
            if not conn.poll(PARENT_CHECK_S):
                if os.getppid() != parent_pid:
                    orphaned = True
                    return
                continue
            task = conn.recv()
            if task is None:
                return
            try:
                conn.send((Msg.result, reader.process(task)))
            except DataError as exc:
                conn.send((Msg.error, task, str(exc)))
            except Exception as exc:  # noqa: BLE001 - any failure on a split is reported as that split's error
                conn.send((Msg.error, task, f"{task.split.where}: {type(exc).__name__}: {_first_line(exc)}"))
    except (EOFError, OSError, BrokenPipeError):
        orphaned = True  # the master is gone
    finally:
        reader.close()
        if orphaned:  # nobody waits for us: skip the interpreter's teardown (slow with pyarrow loaded)
            os._exit(0)
