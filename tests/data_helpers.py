"""Shared helpers of the tests/test_data_*.py files: a small generated dataset and DPP service setups."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from neocfg.config.schema import NeocfgConfig
from neocfg.data.dataset import FeatureColumns, Manifest, dataset_splits, resolve_location
from neocfg.data.dpp.master import ServiceLimits, ServiceSetup
from neocfg.data.dpp.client import DppClient, EndOfData
from neocfg.data.dpp.worker import WorkerSpec
from neocfg.data.parquet_gen import write_dataset
from neocfg.data.transforms import bind
from conftest import compose_cfg

SMALL = ["dsi=parquet_local", "dsi.num_samples=6000", "dsi.eval_samples=800", "dsi.num_files=3",
         "dsi.row_groups_per_file=4", "train.batch_size=128"]


def small_cfg(path: Path, *extra: str) -> NeocfgConfig:
    return compose_cfg([*SMALL, f"dsi.path={path}", *extra])


def make_dataset(path: Path, *extra: str) -> NeocfgConfig:
    cfg = small_cfg(path, *extra)
    write_dataset(cfg)
    return cfg


def setup_for(cfg: NeocfgConfig, **kw) -> ServiceSetup:
    """A finite (one epoch) service over the training splits; keyword arguments override ServiceSetup fields,
    `extra_split_s` and `project` go to the WorkerSpec and `limits` may be a dict of ServiceLimits fields."""
    directory = resolve_location(cfg.dsi.path)
    cols = FeatureColumns.for_model(cfg.model)
    spec = WorkerSpec(columns=cols, transforms=tuple(bind(cfg.dsi.transforms, cols)),
                      batch_size=cfg.train.batch_size, extra_split_s=kw.pop("extra_split_s", 0.0),
                      project=kw.pop("project", True))
    limits = ServiceLimits(**kw.pop("limits", {}))
    args = dict(splits=tuple(dataset_splits(directory, Manifest.load(directory), eval=False)), spec=spec,
                workers=2, seed=7, num_clients=1, max_epochs=1, limits=limits, on_bad_split=cfg.dsi.on_bad_split)
    args.update(kw)
    return ServiceSetup(**args)


def busy_worker(backend: Any, within_s: float = 10.0) -> int:
    """A worker id of the in-process service `backend` that holds a split, once one does."""
    deadline = time.monotonic() + within_s
    while not backend.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    return next(iter(backend.in_flight))


def drain(clients: list[DppClient]) -> list[np.ndarray]:
    """Round-robin over the clients until each reports EndOfData; the sample ids of every batch."""
    out, live = [], list(clients)
    while live:
        for c in list(live):
            try:
                out.append(c.next_arrays().sample_ids)
            except EndOfData:
                live.remove(c)
    return out


def labeled_ids(directory: Path, *, eval: bool = False, skip_files: tuple[str, ...] = ()) -> set[int]:
    """Sample ids the declared label filter keeps (rows with a label), read straight from the files."""
    ids: set[int] = set()
    for f in Manifest.load(directory).files:
        if f.eval != eval or f.name in skip_files:
            continue
        t = pq.read_table(directory / f.name, columns=["label", "sample_id"])
        keep = ~np.isnan(t["label"].to_numpy(zero_copy_only=False))
        ids |= set(t["sample_id"].to_numpy()[keep].tolist())
    return ids
