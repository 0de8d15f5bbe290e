"""The BatchSource for `dsi.source=parquet`: DPP services feeding this trainer rank.

Training reads the `part-*.parquet` files. With `dsi.backend=local` (and `inline`) each rank runs its own service
over its share of the splits (every world-th split, so ranks never share a sample); with `dsi.backend=ray` one
job-wide master actor hands every split of the dataset to whichever rank's client asks next (each sample still goes to
exactly one rank per epoch). Epochs roll over forever. Held-out evaluation (`eval=True`) reads only
`eval-00000.parquet`, which mode=gen_data fills with samples from EVAL_FIRST_SAMPLE on, never seen in training; eval
batches are preprocessed by the same transforms in the trainer's process (the inline backend: eval is short).

A local service starts when the source is made, so workers prefetch while the trainer builds its model;
`load_state_dict` restarts it from the given position. A Ray service starts at the first batch (after any
`load_state_dict`), because its master is shared by every rank and starts from the job's position.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from neocfg.batch import Batch
from neocfg.config.dsi import DsiConfig
from neocfg.config.schema import NeocfgConfig
from neocfg.data.dataset import FeatureColumns, dataset_splits, open_dataset, rank_splits, resolve_location
from neocfg.data.dpp.master import ServiceLimits, ServiceSetup
from neocfg.data.dpp.progress import ClientMark, DeliveryLog, Position
from neocfg.data.dpp.backends import backend_of
from neocfg.data.dpp.service import DppService, make_backend
from neocfg.data.dpp.sizing import PlannedDpp, WorkerCount, WorkerCountSource, worker_count
from neocfg.data.dpp.worker import WorkerSpec
from neocfg.data.transforms import bind
from neocfg.errors import DataError
from neocfg.types import DppBackendKind, TransformOp

# Key of the DPP position inside state_dict(), and of the kind of position it is: a job-wide one (Ray: split
# indices over the whole dataset) or a rank's (local, inline: indices over the rank's share).
STATE_KEY = "dpp_position"
SCOPE_KEY = "dpp_scope"

# A directory: every rank's client appends each sample it hands out, as (epoch, sample_id) int64 pairs, to
# rank<r>.bin there (progress.DeliveryLog), to check exactly-once delivery on a real cluster.
AUDIT_ENV = "NEOCFG_DPP_AUDIT"

# Rank 0's value, given to every rank (the runtime's broadcast; identity in a single process).
Share = Callable[[Any], Any]


class DppSource:
    """A BatchSource backed by a DPP service with one client (this rank)."""

    def __init__(self, setup: ServiceSetup, kind: DppBackendKind, workers: WorkerCount, *, client: int = 0,
                 options: Any = None, log: Optional[Path] = None) -> None:
        """`options`: what the backend's connect gave this rank (job-wide backends); `log`: the file of this rank's
        DeliveryLog (none by default)."""
        self.setup, self.kind, self.workers, self.client_index = setup, kind, workers, client
        self.options, self.log = options, log
        self.service: Optional[DppService] = None
        if not backend_of(kind).job_wide:
            self._start()

    def _start(self) -> None:
        backend = make_backend(self.kind, self.setup, self.options)
        self.service = DppService(self.setup, self.kind, clients=[self.client_index], backend=backend).start()
        if self.log is not None:
            self.service.clients[0].log = DeliveryLog(self.log)

    def _client(self):
        if self.service is None:
            self._start()
        return self.service.clients[0]

    def next_batch(self) -> Batch:
        a = self._client().next_arrays()
        return Batch(dense=torch.from_numpy(a.dense), lengths=torch.from_numpy(a.lengths),
                     values=torch.from_numpy(a.values), labels=torch.from_numpy(a.labels),
                     sample_ids=torch.from_numpy(a.sample_ids),
                     weights=None if a.weights is None else torch.from_numpy(a.weights))

    def position(self, mark: Optional[ClientMark] = None) -> Position:
        """The position after the batches handed out up to `mark` (default: now); a job-wide service waits for
        every rank's client here (the trainers call it at the same checkpoint step)."""
        if self.service is None:
            return self.setup.start
        return self.service.position({self.client_index: mark} if mark is not None else None)

    def mark(self) -> Optional[ClientMark]:
        """This rank's client's record before the next batch: local, no message to the service."""
        return self.service.clients[0].mark() if self.service is not None else None

    @property
    def scope(self) -> str:
        return "job" if backend_of(self.kind).job_wide else "rank"

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: self.position().to_state(), SCOPE_KEY: self.scope}

    def state_at(self, mark: Optional[ClientMark]) -> dict[str, Any]:
        """The checkpoint state after the batches up to `mark` (None: taken before the service started, so the
        position it started from)."""
        pos = self.position(mark) if mark is not None else self.setup.start
        return {STATE_KEY: pos.to_state(), SCOPE_KEY: self.scope}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if STATE_KEY not in state:
            raise DataError(f"checkpoint has no {STATE_KEY!r}: it was not written by a dsi.source=parquet run")
        saved = state.get(SCOPE_KEY, "rank")
        if saved != self.scope:
            was = "dsi.backend=ray" if saved == "job" else "dsi.backend=local (or inline)"
            raise DataError(f"the checkpoint's DPP position was written with {was}; resume with the same "
                            f"dsi.backend (this run: {self.kind.value})")
        self.close()
        self.setup = dataclasses.replace(self.setup, start=Position.from_state(state[STATE_KEY]))

    def stats(self) -> dict[str, Any]:
        """Flat keys, per rank. data_wait_seconds: all time spent in next_batch; data_first_batch_seconds: the first
        call's part of it (worker start-up); data_stall_fraction: the rest over the wall time since the first batch.
        The service's counters (dpp.*) come from the rank that owns the service: every rank locally, rank 0 for a
        job-wide Ray service."""
        out: dict[str, Any] = {"data_wait_seconds": 0.0, "data_first_batch_seconds": 0.0,
                               "data_stall_fraction": 0.0, "samples_delivered": 0, "duplicate_samples": 0,
                               "skipped_splits": 0, "dpp.workers": 0, "dpp.worker_restarts": 0, "dpp.bytes_read": 0,
                               "dpp.workers_added": 0, "dpp.workers_retired": 0, "dpp.splits_reread": 0,
                               "dpp.ids_truncated": 0, "dpp.backups": 0, "dpp.backups_dropped": 0,
                               "dpp.workers_source": self.workers.source.value, "dpp.backend": self.kind.value}
        if self.service is None:
            return out
        c = self.service.clients[0]
        out.update({"data_wait_seconds": c.wait_s, "data_first_batch_seconds": c.first_wait_s or 0.0,
                    "data_stall_fraction": c.stall_fraction, "samples_delivered": c.delivered,
                    "duplicate_samples": c.tracker.duplicates})
        if backend_of(self.kind).job_wide and self.client_index != 0:
            return out
        s = self.service.stats()
        out.update({"duplicate_samples": c.tracker.duplicates + s.duplicate_rows,
                    "skipped_splits": s.splits_skipped, "dpp.workers": s.workers,
                    "dpp.worker_restarts": s.worker_restarts, "dpp.workers_added": s.workers_added,
                    "dpp.workers_retired": s.workers_retired, "dpp.bytes_read": s.bytes_read,
                    "dpp.splits_reread": s.splits_reread,
                    "dpp.ids_truncated": s.ids_cut, "dpp.backups": s.backups,
                    "dpp.backups_dropped": s.backups_dropped})
        return out

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
            self.service = None


def _say(rank: int, line: str) -> None:
    if line and rank == 0:
        print(line, flush=True)


def make_dpp_source(cfg: NeocfgConfig, rank: int, world_size: int, *, eval: bool = False,
                    sizing: Optional[PlannedDpp] = None, share: Optional[Share] = None) -> DppSource:
    """`sizing`: the planner's DPP sizing (dsi.workers=auto), handed over by the runtime; `share`: rank 0's value
    to every rank (the Ray backend's cluster address)."""
    d = cfg.dsi
    columns = FeatureColumns.for_model(cfg.model, d.columns)
    directory, manifest = open_dataset(resolve_location(d.path), d.eval_files)
    every = dataset_splits(directory, manifest, eval=eval)
    if not every:
        hint = (f"name held-out files to match dsi.eval_files={d.eval_files!r}, or set train.eval_batches=0" if eval
                else f"its only .parquet files match dsi.eval_files={d.eval_files!r}")
        raise DataError(f"{directory}: the dataset has no {'eval' if eval else 'training'} files; {hint}")
    kind = DppBackendKind.inline if eval else d.backend
    job_wide = backend_of(kind).job_wide
    splits = every if job_wide else rank_splits(every, rank, world_size)
    _warn_small_dataset(cfg, rank, world_size, sum(s.rows for s in every), eval)
    spec = WorkerSpec(columns=columns, transforms=tuple(bind(d.transforms, columns)), batch_size=cfg.train.batch_size)
    if not eval:
        for bt in spec.transforms:
            if bt.config.op is TransformOp.truncate and bt.columns:
                _say(rank, f"DPP: dsi.transforms.{bt.index} truncates the bags of {bt.config.column} to "
                           f"{bt.config.max_ids} ids; the ids cut are counted as dpp.ids_truncated in metrics.json")
    if eval:
        workers = WorkerCount(total=world_size, per_service=1, source=WorkerCountSource.fixed)
    else:
        hw = cfg.hardware
        workers = worker_count(d, world_size, sizing, kind, cpus=hw.host.cpu_cores,
                               ranks_per_host=min(hw.devices_per_node, world_size))
        _say(rank, workers.warning)
        _say(rank, workers.note if workers.source is not WorkerCountSource.fixed else "")
    per = workers.per_service
    limits = service_limits(d, per)
    scope = "the job's" if job_wide else ("this rank's" if world_size > 1 else "the dataset's")
    setup = ServiceSetup(splits=tuple(splits), spec=spec, workers=per, seed=d.seed + (0 if job_wide else rank),
                         num_clients=world_size if job_wide else 1, on_bad_split=d.on_bad_split, limits=limits,
                         scope=scope)
    audit = os.environ.get(AUDIT_ENV)
    log = Path(audit) / f"rank{rank}.bin" if audit and not eval else None
    backend = backend_of(kind)
    if backend.connect is None:
        return DppSource(setup, kind, workers, log=log)
    options, said = backend.connect(d, rank, share or (lambda x: x), sizing, per)
    _say(rank, said)
    return DppSource(setup, kind, workers, client=rank, options=options, log=log)


def service_limits(d: DsiConfig, per: int) -> ServiceLimits:
    """The service's limits for `per` planned workers: with dsi.autoscale, the master scales between per divided and
    multiplied by dsi.autoscale_factor (at most dsi.max_workers)."""
    return ServiceLimits(prefetch_splits=d.prefetch_splits, split_timeout_s=d.split_timeout_s,
                         stall_timeout_s=d.stall_timeout_s, autoscale=d.autoscale,
                         max_workers=min(d.max_workers, math.ceil(per * d.autoscale_factor)) if d.autoscale
                         else d.max_workers,
                         min_workers=max(1, math.floor(per / d.autoscale_factor)))


def _warn_small_dataset(cfg: NeocfgConfig, rank: int, world_size: int, rows: int, eval: bool) -> None:
    """A step (or the evaluation) that needs more samples than the files hold repeats samples: say so."""
    b = cfg.train.batch_size
    if eval:
        need = cfg.train.eval_batches * b * world_size
        if need > rows:
            _say(rank, f"neocfg: warning: held-out evaluation reads {need:,} samples (train.eval_batches="
                       f"{cfg.train.eval_batches} x train.batch_size={b} x {world_size} ranks) but the eval file has "
                       f"{rows:,}: samples are evaluated more than once")
    elif b * world_size > rows:
        _say(rank, f"neocfg: warning: train.batch_size={b} x {world_size} ranks = {b * world_size:,} samples per step"
                   f" is more than the dataset's {rows:,} training samples ({cfg.dsi.path}): every step repeats"
                   " samples")
