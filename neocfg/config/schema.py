"""The whole neocfg config: one typed dataclass per section, registered in Hydra's ConfigStore.

conf/config.yaml lists `neocfg_schema` first in its defaults, so every preset and override is type-checked against
these dataclasses during composition; `load()` then runs the range and cross-field checks and returns typed objects.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from neocfg.config.dsi import DsiConfig
from neocfg.config.hardware import HardwareConfig
from neocfg.config.model import ModelConfig
from neocfg.config.numbers import accept_integral_floats
from neocfg.config.planner import PlannerConfig
from neocfg.config.sweep import SweepConfig
from neocfg.config.train import TrainConfig
from neocfg.errors import ConfigError
from neocfg.types import DensePrecision, DeviceKind, Mode, WeightsDtype
from neocfg.units import GIB


@dataclass
class NeocfgConfig:
    mode: Mode = Mode.describe
    # Show Python tracebacks for errors (NEOCFG_DEBUG=1 does the same, also for composition errors).
    debug: bool = False
    model: ModelConfig = MISSING
    hardware: HardwareConfig = MISSING
    dsi: DsiConfig = MISSING
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)

    def check(self) -> None:
        self.model.check("model")
        self.hardware.check("hardware")
        self.dsi.check("dsi")
        self.planner.check("planner")
        self.train.check("train")
        self._check_sizes_could_fit()
        world = self.hardware.num_devices
        for i, table in enumerate(self.model.tables):
            for j, rank in enumerate(table.ranks or []):
                if rank >= world:
                    raise ConfigError(f"model.tables.{i}.ranks.{j}", rank,
                                      f"must be a rank in [0, {world - 1}] (world size {world})")


    def _check_sizes_could_fit(self) -> None:
        """A table no cluster of this hardware could hold (e.g. num_embeddings=1e23) is a typo, not a planning
        question: refuse it here, before any cost arithmetic overflows."""
        hw = self.hardware
        if hw.nodes > MAX_NODES:
            raise ConfigError("hardware.nodes", hw.nodes, f"must be <= {MAX_NODES:,} (the largest cluster neocfg plans)")
        if hw.devices_per_node > MAX_DEVICES_PER_NODE:
            raise ConfigError("hardware.devices_per_node", hw.devices_per_node, f"must be <= {MAX_DEVICES_PER_NODE}")
        for key, gib in (("hardware.device.hbm_gib", hw.device.hbm_gib), ("hardware.host.ddr_gib", hw.host.ddr_gib)):
            if gib > MAX_MEMORY_GIB:
                raise ConfigError(key, gib, f"must be <= {MAX_MEMORY_GIB:,} GiB (1 PiB: no device or host has more)")
        per_node = (hw.device.hbm_gib * hw.devices_per_node + hw.host.ddr_gib) * GIB
        most = per_node * MAX_NODES
        smallest = min(d.bytes for d in WeightsDtype)
        for i, table in enumerate(self.model.tables):
            need = table.num_embeddings * table.embedding_dim * smallest
            if need > most:
                raise ConfigError(
                    f"model.tables.{i}.num_embeddings", table.num_embeddings,
                    f"table {table.name} needs {need / GIB:,.3g} GiB even at fp16, more than {MAX_NODES:,} nodes of"
                    f" {hw.name} hold ({most / GIB:,.0f} GiB of HBM + host DDR); no cluster could hold it")


# The largest cluster neocfg reasons about (in nodes): a model bigger than this many nodes of the chosen hardware
# hold is refused as a typo; the planner's advice never suggests more (neocfg/planner/advice.py).
MAX_NODES = 1024
# Accelerators per node: the densest training nodes hold 8-16 (DGX / ZionEX: 8; NVL-style trays up to 72 behind one
# switch are still addressed as 8-GPU hosts); 64 leaves room and keeps per-node arrays small.
MAX_DEVICES_PER_NODE = 64
# Memory of one device or host, GiB: 1 PiB, far beyond any machine; larger values are typos that overflow the
# cost arithmetic (e.g. hbm_gib=1e300 -> inf bytes).
MAX_MEMORY_GIB = 2**20

SCHEMA_NAME = "neocfg_schema"


# At import, not only in register(): Hydra's joblib launcher composes each job's config in a loky worker, which
# imports this module (through neocfg.cli) but never runs the parent's register().
accept_integral_floats()


def register() -> None:
    accept_integral_floats()
    ConfigStore.instance().store(name=SCHEMA_NAME, node=NeocfgConfig)


# What each required key is, with a typical value: a preset that lacks some is told all of them at once.
REQUIRED_HINTS = {
    "model.name": "the model's name",
    "model.tables": "the embedding tables, e.g. [{name: t0, num_embeddings: 1e6, embedding_dim: 64}]",
    "model.tables.*.name": "the table's name",
    "model.tables.*.num_embeddings": "rows of the table, e.g. 1e6",
    "model.tables.*.embedding_dim": "columns of the table, e.g. 64",
    "hardware.name": "the preset's name",
    "hardware.device.hbm_gib": "memory of one device in GiB (a CPU rank's budget), e.g. 80 for an H100 SXM",
    "hardware.device.hbm_bandwidth_gbs": "one device's memory bandwidth in GB/s, e.g. 3350 for an H100 SXM",
    "hardware.host.ddr_gib": "host DRAM of one node in GiB, e.g. 2048",
    "hardware.host.ddr_bandwidth_gbs": "host DRAM bandwidth of one node in GB/s, e.g. 300",
    "hardware.intra_node_bandwidth_gbs": "all-to-all bandwidth per device within a node in GB/s (NVLink), e.g. 900"
                                         " for H100 NVLink 4 (aggregate per GPU)",
    "hardware.inter_node_bandwidth_gbs": "all-to-all bandwidth per device between nodes in GB/s, e.g. 50 for one"
                                         " 400 Gb/s NIC per GPU",
    "dsi.name": "the data pipeline preset's name",
    "dsi.worker_shapes.*.name": "the worker shape's name, e.g. cpu_host_64c",
    "dsi.worker_shapes.*.cores": "cores of one DPP worker host, e.g. 64",
    "dsi.worker_shapes.*.nic_gbs": "network bandwidth of one DPP worker host in GB/s, e.g. 3.125 (25 Gb/s)",
    "dsi.worker_shapes.*.memory_bandwidth_gbs": "memory bandwidth of one DPP worker host in GB/s, e.g. 200",
}


def _missing_required(cfg: DictConfig) -> None:
    """Every required key the composed config lacks, in one line, each with what it is and a typical value."""
    import re

    missing = sorted(re.sub(r"\[(\d+)\]", r".\1", k) for k in OmegaConf.missing_keys(cfg))
    if not missing:
        return
    said = [f"{k} ({REQUIRED_HINTS[h]})" if (h := re.sub(r"\.\d+\.", ".*.", k)) in REQUIRED_HINTS else k
            for k in missing]
    template = " (a template hardware preset: docs/hardware.md)" if any(k.startswith("hardware.") for k in missing) else ""
    raise ConfigError(missing[0], ConfigError.NO_VALUE,
                      f"required but not given; {len(missing)} required key{'s' if len(missing) > 1 else ''} missing:"
                      f" {'; '.join(said)}{template}")


def load(cfg: DictConfig) -> NeocfgConfig:
    """Turn the composed DictConfig into typed dataclasses and run every range and cross-field check."""
    _reject_unknown_keys(cfg, "")
    _missing_required(cfg)
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as exc:  # MissingMandatoryValue and friends: re-raised as one line by the CLI
        raise _from_omegaconf(exc) from exc
    assert isinstance(obj, NeocfgConfig)
    reject_non_finite(obj, "")
    if isinstance(obj.model.tables, list) and obj.model.shrink:
        obj.model.shrink_to.check("model.shrink_to")
        obj.model, note = obj.model.shrunk()
        print(f"neocfg: note: {note}", file=sys.stderr)
    if isinstance(obj.model.tables, list):
        obj.model, note = obj.model.with_interaction_resolved()
        if note:
            print(f"neocfg: note: {note}", file=sys.stderr)
    obj.check()
    warning = missing_peak_warning(obj)
    if warning:
        print(warning, file=sys.stderr)
    return obj


# Dense peaks (TFLOP/s, dense, no sparsity) of an H100 SXM, the typical value a missing peak's warning quotes.
# Source: NVIDIA H100 Tensor Core GPU datasheet (TF32 989 and BF16 1,979 TFLOP/s with sparsity, halved).
TYPICAL_PEAK_TFLOPS = {DensePrecision.tf32: 495.0, DensePrecision.bf16: 989.0}


def missing_peak_warning(cfg: NeocfgConfig) -> str | None:
    """A GPU preset without the peak of the training precision would be rated at its fp32 peak without a word: say
    so (plan and train only)."""
    precision, device = cfg.train.dense_precision, cfg.hardware.device
    if cfg.mode not in (Mode.plan, Mode.train) or device.kind is not DeviceKind.gpu:
        return None
    if precision not in TYPICAL_PEAK_TFLOPS or getattr(device, f"peak_tflops_{precision.value}") is not None:
        return None
    key = f"hardware.device.peak_tflops_{precision.value}"
    return (f"neocfg: warning: {key} is not set: the dense part at train.dense_precision={precision.value} is rated"
            f" at the fp32 peak ({device.peak_tflops:g} TFLOP/s); set it (e.g. {TYPICAL_PEAK_TFLOPS[precision]:g} for"
            f" an H100 SXM) or train.dense_precision=fp32")


def reject_non_finite(node: Any, path: str) -> None:
    """NaN and inf pass every `> 0` / range check (inf) or compare false everywhere (NaN): refuse them in any
    section, naming the full key path."""
    if isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(path, node, "must be a finite number (not NaN or inf)")
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            reject_non_finite(getattr(node, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            reject_non_finite(item, f"{path}.{i}")
    elif isinstance(node, dict):
        for key, item in node.items():
            reject_non_finite(item, f"{path}.{key}")


def _reject_unknown_keys(node: object, path: str) -> None:
    """Keys forced in with `+key=value` bypass the schema's struct flag; refuse any the dataclasses lack."""
    if isinstance(node, DictConfig):
        cls = OmegaConf.get_type(node)
        known = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
        for key in node.keys():
            sub = f"{path}.{key}" if path else str(key)
            if known is not None and key not in known:
                raise ConfigError(sub, ConfigError.NO_VALUE, f"unknown key (not a field of {cls.__name__})")
            _reject_unknown_keys(node._get_node(key), sub)
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            _reject_unknown_keys(node._get_node(i), f"{path}.{i}")


def _from_omegaconf(exc: Exception) -> ConfigError:
    from neocfg.cli_errors import omegaconf_error_to_config_error

    return omegaconf_error_to_config_error(exc)
