"""mode=describe: validate the config and summarize the model, the cluster and whether the model can fit at all."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from neocfg.config.schema import NeocfgConfig
from neocfg.units import GIB, fmt_bytes

# Row-wise Adagrad keeps one fp32 accumulator per row: the least optimizer state a trainable table needs.
ROWWISE_STATE_BYTES_PER_ROW = 4
MAX_LISTED_TABLES = 20


@dataclass(frozen=True)
class ModelSummary:
    name: str
    num_tables: int
    total_rows: int
    total_parameters: int
    bytes_fp32: int
    bytes_fp16: int
    optimizer_state_bytes: int
    lookups_per_sample: float
    world_size: int
    nodes: int
    hbm_bytes_per_device: int
    hbm_bytes_total: int
    host_bytes_per_node: int
    host_bytes_total: int
    fits_hbm_fp32: bool
    fits_hbm_fp16: bool
    fits_hbm_plus_host: bool


def summarize(cfg: NeocfgConfig) -> ModelSummary:
    model, hw = cfg.model, cfg.hardware
    rows = sum(t.num_embeddings for t in model.tables)
    params = model.num_parameters
    state = rows * ROWWISE_STATE_BYTES_PER_ROW
    hbm_dev = int(hw.device.hbm_gib * GIB)
    host_node = int(hw.host.ddr_gib * GIB)
    hbm_total, host_total = hbm_dev * hw.num_devices, host_node * hw.nodes
    return ModelSummary(
        name=model.name, num_tables=len(model.tables), total_rows=rows, total_parameters=params,
        bytes_fp32=4 * params, bytes_fp16=2 * params, optimizer_state_bytes=state,
        lookups_per_sample=sum(t.pooling_factor for t in model.tables),
        world_size=hw.num_devices, nodes=hw.nodes,
        hbm_bytes_per_device=hbm_dev, hbm_bytes_total=hbm_total,
        host_bytes_per_node=host_node, host_bytes_total=host_total,
        fits_hbm_fp32=4 * params + state <= hbm_total,
        fits_hbm_fp16=2 * params + state <= hbm_total,
        fits_hbm_plus_host=2 * params + state <= hbm_total + host_total,
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render(cfg: NeocfgConfig, s: ModelSummary) -> str:
    model, hw = cfg.model, cfg.hardware
    lines = [f"model {s.name}: {s.num_tables} tables, {s.total_rows:,} rows, {s.total_parameters:,} embedding parameters",
             f"  interaction {model.interaction.value}; bottom MLP {model.num_dense_features}-"
             + "-".join(map(str, model.bottom_layers)) + "; top MLP " + "-".join(map(str, model.top_mlp)),
             f"  {'table':<16}{'rows':>15}{'dim':>6}{'pooling':>9}{'zipf':>6}{'fp32':>14}"]
    by_size = sorted(model.tables, key=lambda t: t.num_parameters, reverse=True)
    shown = by_size[:MAX_LISTED_TABLES] if len(by_size) > MAX_LISTED_TABLES else model.tables
    for t in shown:
        lines.append(f"  {t.name:<16}{t.num_embeddings:>15,}{t.embedding_dim:>6}{t.pooling_factor:>9.2f}"
                     f"{t.alpha:>6.2f}{fmt_bytes(4 * t.num_parameters):>14}")
    if len(shown) < len(model.tables):
        lines.append(f"  ... and {len(model.tables) - len(shown)} smaller tables")
    lines += [
        f"  weights: {fmt_bytes(s.bytes_fp32)} at fp32, {fmt_bytes(s.bytes_fp16)} at fp16;"
        f" row-wise Adagrad state {fmt_bytes(s.optimizer_state_bytes)}",
        f"  lookups per sample: {s.lookups_per_sample:,.1f}",
        f"hardware {hw.name}: {hw.nodes} node(s) x {hw.devices_per_node} {hw.device.model} = world size {s.world_size}"
        f" ({hw.backend.value})",
        f"  memory per device: {fmt_bytes(s.hbm_bytes_per_device)} HBM at {hw.device.hbm_bandwidth_gbs:,.0f} GB/s;"
        f" per node: {fmt_bytes(s.host_bytes_per_node)} host DDR",
        f"  memory in total: {fmt_bytes(s.hbm_bytes_total)} HBM, {fmt_bytes(s.host_bytes_total)} host DDR",
        f"  bandwidth per device: intra-node {hw.intra_node_bandwidth_gbs:,.0f} GB/s,"
        f" inter-node {hw.inter_node_bandwidth_gbs:,.0f} GB/s",
        f"could fit: all in HBM at fp32 {_yes(s.fits_hbm_fp32)}; all in HBM at fp16 {_yes(s.fits_hbm_fp16)};"
        f" HBM + host DDR at fp16 {_yes(s.fits_hbm_plus_host)}",
        f"  (embedding weights + row-wise Adagrad state vs total capacity; the planner decides the real placement)",
    ]
    return "\n".join(lines)


def run(cfg: NeocfgConfig, run_dir: Path | None) -> ModelSummary:
    summary = summarize(cfg)
    print(render(cfg, summary))
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "describe.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
        print(f"summary written to {run_dir / 'describe.json'}")
    return summary
