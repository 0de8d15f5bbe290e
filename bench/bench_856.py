"""Samples/s and the step breakdown of a prod_856-shaped model trained on cpu_local.

The model: prod_856's 856 tables and pooling factors, every table dim 16 and capped at 20,000 rows (so that it fits
a CPU), `interaction: dcn` (one low-rank layer of rank 16), bottom MLP [64, 16], top MLP [64, 1]. Two gloo ranks,
batch 256 per rank, through mode=train's own entry (neocfg.contract.train), once per sharding type. Prints
samples/s and data_wait + comm_input as a share of the step (the target is <= 10% for both).

    .venv/bin/python bench/bench_856.py [--steps 20] [--sharding table_wise,row_wise] [--out 856.json] [--pooling-scale 2.6]
        [--set train.ids_exchange=step ...]   (extra config overrides, e.g. the ids exchanged in the step)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compose_cfg, emit  # noqa: E402

from neocfg.config.schema import NeocfgConfig  # noqa: E402
from neocfg.contract import train as run  # noqa: E402

ROWS_CAP = 20_000
DIM = 16


def config(sharding: str, steps: int, batch: int, extra: tuple[str, ...] = (), pooling_scale: float = 1.0
           ) -> NeocfgConfig:
    cfg = compose_cfg(["model=prod_856", "hardware=cpu_local", "mode=train", f"train.steps={steps}",
                       f"train.batch_size={batch}", "train.eval_batches=0", f"train.log_every={steps}",
                       f"planner.sharding_types=[{sharding}]", "model.interaction=dcn", "model.dcn_low_rank_dim=16",
                       "model.dcn_num_layers=1", "model.bottom_mlp=[64,16]", "model.top_mlp=[64,1]",
                       "model.planning_only=false", *extra])
    tables = [dataclasses.replace(t, embedding_dim=DIM, num_embeddings=min(t.num_embeddings, ROWS_CAP),
                                  pooling_factor=t.pooling_factor * pooling_scale)
              for t in cfg.model.tables]
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tables=tables))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sharding", default="table_wise,row_wise")
    ap.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    ap.add_argument("--pooling-scale", type=float, default=1.0,
                    help="every table's pooling factor times this (2.6: about 12,600 ids per sample)")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sharding in a.sharding.split(","):
            m = run(config(sharding, a.steps, a.batch, tuple(a.set), a.pooling_scale), Path(tmp) / sharding)
            b = m.breakdown_ms
            share = (b["data_wait"] + b["comm_input"]) / m.measured_step_ms
            rows.append({"sharding": sharding, "samples_per_s": m.samples_per_s,
                         "measured_step_ms": m.measured_step_ms, "predicted_step_ms": m.predicted_step_ms,
                         "data_wait_plus_comm_input_share": share, "breakdown_ms": b})
            print(f"{sharding}: {m.samples_per_s:.0f} samples/s, step {m.measured_step_ms:.0f} ms, "
                  f"data_wait {b['data_wait']:.1f} ms + comm_input {b['comm_input']:.1f} ms = {share:.1%} "
                  f"(target <= 10%)", file=sys.stderr)
    emit({"bench": "prod_856_shaped_cpu_local", "rows_cap": ROWS_CAP, "dim": DIM, "batch_per_rank": a.batch,
          "steps": a.steps, "overrides": a.set, "pooling_scale": a.pooling_scale, "runs": rows}, a.out)


if __name__ == "__main__":
    main()
