"""The whole neocfg config: one typed dataclass per section, registered in Hydra's ConfigStore.

conf/config.yaml lists `neocfg_schema` first in its defaults, so every preset and override is type-checked against
these dataclasses during composition; `load()` then runs the range and cross-field checks and returns typed objects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from neocfg.config.dsi import DsiConfig
from neocfg.config.hardware import HardwareConfig
from neocfg.config.model import ModelConfig
from neocfg.config.planner import PlannerConfig
from neocfg.config.sweep import SweepConfig
from neocfg.config.train import TrainConfig
from neocfg.errors import ConfigError
from neocfg.types import Mode


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
        world = self.hardware.num_devices
        for i, table in enumerate(self.model.tables):
            for j, rank in enumerate(table.ranks or []):
                if rank >= world:
                    raise ConfigError(f"model.tables.{i}.ranks.{j}", rank,
                                      f"must be a rank in [0, {world - 1}] (world size {world})")


SCHEMA_NAME = "neocfg_schema"


def register() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=NeocfgConfig)


def load(cfg: DictConfig) -> NeocfgConfig:
    """Turn the composed DictConfig into typed dataclasses and run every range and cross-field check."""
    _reject_unknown_keys(cfg, "")
    try:
        obj = OmegaConf.to_object(cfg)
    except Exception as exc:  # MissingMandatoryValue and friends: re-raised as one line by the CLI
        raise _from_omegaconf(exc) from exc
    assert isinstance(obj, NeocfgConfig)
    obj.check()
    return obj


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
