"""The BatchSource for `dsi.source=parquet`: one DPP service per trainer rank over that rank's share of the splits.

Training reads the `part-*.parquet` files; rank r of W takes every W-th split (so ranks never share a sample) and
rolls over epochs forever. Held-out evaluation (`eval=True`) reads only `eval-00000.parquet`, which mode=gen_data fills
with samples from EVAL_FIRST_SAMPLE on, never seen in training; eval batches are preprocessed by the same transforms
but in the trainer's process (the inline backend: eval is short and needs no worker processes).

The service starts when the source is made, so workers prefetch while the trainer builds its model;
`load_state_dict` restarts it from the given position (before any batch was taken that costs one worker start).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from neocfg.batch import Batch
from neocfg.config.schema import NeocfgConfig
from neocfg.data.dataset import FeatureColumns, Manifest, dataset_splits, rank_splits, resolve_path
from neocfg.data.dpp.backend import ServiceLimits, ServiceSetup
from neocfg.data.dpp.progress import Position
from neocfg.data.dpp.service import DppService
from neocfg.data.dpp.sizing import WorkerCount, WorkerCountSource, worker_count
from neocfg.data.dpp.worker import WorkerSpec
from neocfg.data.transforms import bind
from neocfg.errors import DataError
from neocfg.plan import Plan
from neocfg.types import DppBackendKind

# Key of the DPP position inside state_dict().
STATE_KEY = "dpp_position"


class DppSource:
    """A BatchSource backed by a DPP service with one client (this rank)."""

    def __init__(self, setup: ServiceSetup, kind: DppBackendKind, workers: WorkerCount) -> None:
        self.setup, self.kind, self.workers = setup, kind, workers
        self.service: Optional[DppService] = None
        self._start()

    def _start(self) -> None:
        self.service = DppService(self.setup, self.kind).start()

    def _client(self):
        if self.service is None:
            self._start()
        return self.service.clients[0]

    def next_batch(self) -> Batch:
        a = self._client().next_arrays()
        return Batch(dense=torch.from_numpy(a.dense), lengths=torch.from_numpy(a.lengths),
                     values=torch.from_numpy(a.values), labels=torch.from_numpy(a.labels),
                     sample_ids=torch.from_numpy(a.sample_ids))

    def position(self) -> Position:
        return self.service.clients[0].position() if self.service is not None else self.setup.start

    def state_dict(self) -> dict[str, Any]:
        return {STATE_KEY: self.position().to_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if STATE_KEY not in state:
            raise DataError(f"checkpoint has no {STATE_KEY!r}: it was not written by a dsi.source=parquet run")
        self.close()
        self.setup = dataclasses.replace(self.setup, start=Position.from_state(state[STATE_KEY]))

    def stats(self) -> dict[str, Any]:
        """Flat keys, per rank. data_wait_seconds: all time spent in next_batch; data_first_batch_seconds: the first
        call's part of it (worker start-up); data_stall_fraction: the rest over the wall time since the first batch."""
        if self.service is None:
            return {"data_wait_seconds": 0.0, "data_first_batch_seconds": 0.0, "data_stall_fraction": 0.0,
                    "samples_delivered": 0, "duplicate_samples": 0, "skipped_splits": 0, "dpp.workers": 0,
                    "dpp.worker_restarts": 0, "dpp.bytes_read": 0, "dpp.workers_source": self.workers.source.value}
        c, s = self.service.clients[0], self.service.stats()
        return {"data_wait_seconds": c.wait_s, "data_first_batch_seconds": c.first_wait_s or 0.0,
                "data_stall_fraction": c.stall_fraction,
                "samples_delivered": c.delivered, "duplicate_samples": c.tracker.duplicates,
                "skipped_splits": s.splits_skipped, "dpp.workers": s.workers, "dpp.worker_restarts": s.worker_restarts,
                "dpp.workers_added": s.workers_added, "dpp.workers_retired": s.workers_retired,
                "dpp.bytes_read": s.bytes_read, "dpp.workers_source": self.workers.source.value}

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
            self.service = None


def make_dpp_source(cfg: NeocfgConfig, rank: int, world_size: int, *, eval: bool = False,
                    plan: Optional[Plan] = None) -> DppSource:
    d = cfg.dsi
    directory = resolve_path(d.path)
    manifest = Manifest.load(directory)
    splits = rank_splits(dataset_splits(directory, manifest, eval=eval), rank, world_size)
    if not splits:
        raise DataError(f"{directory}: the dataset has no {'eval' if eval else 'training'} files")
    columns = FeatureColumns.for_model(cfg.model)
    spec = WorkerSpec(columns=columns, transforms=tuple(bind(d.transforms, columns)), batch_size=cfg.train.batch_size)
    if eval:
        workers, kind = WorkerCount(total=world_size, per_service=1, source=WorkerCountSource.fixed), \
            DppBackendKind.inline
    else:
        workers, kind = worker_count(cfg, world_size, plan), d.backend
    limits = ServiceLimits(prefetch_splits=d.prefetch_splits, split_timeout_s=d.split_timeout_s,
                           stall_timeout_s=d.stall_timeout_s, max_workers=d.max_workers, autoscale=d.autoscale)
    setup = ServiceSetup(splits=tuple(splits), spec=spec, workers=workers.per_service, seed=d.seed + rank,
                         on_bad_split=d.on_bad_split, limits=limits)
    return DppSource(setup, kind, workers)
