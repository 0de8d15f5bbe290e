"""Integer keys take numbers as people write them: `num_embeddings=1e7`, `steps: 2.0` (YAML and Hydra read both as
floats, which OmegaConf's integer nodes refuse). An integral float becomes that integer; a non-integral one is refused
with one line naming the key and the value."""

from __future__ import annotations

import math
from typing import Any, Callable

from omegaconf.errors import ValidationError
from omegaconf.nodes import IntegerNode

_ORIGINAL: Callable[[IntegerNode, Any], int] = IntegerNode._validate_and_convert_impl


def as_integer(value: Any) -> Any:
    """value as an int when it is an integral float (or such a float written as a string, e.g. '1e7');
    ValidationError when it is a float with a fractional part; else value unchanged (OmegaConf decides)."""
    number = value
    if type(value) is str:
        try:
            int(value)
            return value
        except ValueError:
            try:
                number = float(value)
            except ValueError:
                return value
    if type(number) is not float:
        return value
    if not math.isfinite(number):
        raise ValidationError("Value '$VALUE' is not a whole number (integer keys take e.g. 1e7 or 2.0)")
    if not number.is_integer():
        raise ValidationError("Value '$VALUE' is not a whole number (integer keys take e.g. 1e7 or 2.0, not a"
                              " fraction)")
    return int(number)


def _validate_and_convert(self: IntegerNode, value: Any) -> int:
    return _ORIGINAL(self, as_integer(value))


def accept_integral_floats() -> None:
    """Make every integer key of the schema take integral floats (idempotent)."""
    IntegerNode._validate_and_convert_impl = _validate_and_convert  # type: ignore[method-assign]
