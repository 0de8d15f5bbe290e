"""Small value checks shared by the config sections; each raises ConfigError naming the full key path."""

from __future__ import annotations

from typing import Any, Sequence

from neocfg.errors import ConfigError


def positive(key: str, value: float | int) -> None:
    if value is None or value <= 0:
        raise ConfigError(key, value, "must be > 0")


def non_negative(key: str, value: float | int) -> None:
    if value is None or value < 0:
        raise ConfigError(key, value, "must be >= 0")


def in_range(key: str, value: float, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> None:
    too_low = value <= lo if lo_open else value < lo
    too_high = value >= hi if hi_open else value > hi
    if too_low or too_high:
        lb, rb = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise ConfigError(key, value, f"must be in {lb}{lo}, {hi}{rb}")


def non_empty(key: str, value: Any) -> None:
    if value is None or (hasattr(value, "__len__") and len(value) == 0):
        raise ConfigError(key, value, "must not be empty")


def all_positive(key: str, values: Sequence[int | float]) -> None:
    for i, v in enumerate(values):
        positive(f"{key}.{i}", v)


def unique(key: str, values: Sequence[str], field: str = "name") -> None:
    """`values[i]` is `<key>.<i>.<field>`; every value must be unique."""
    seen: dict[str, int] = {}
    for i, v in enumerate(values):
        if v in seen:
            raise ConfigError(f"{key}.{i}.{field}", v, f"duplicate; already used by {key}.{seen[v]}.{field}; must be unique")
        seen[v] = i
