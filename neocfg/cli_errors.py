"""Turn Hydra / OmegaConf / neocfg exceptions into one readable line naming the key, the value and what is allowed."""

from __future__ import annotations

import re

from omegaconf.errors import OmegaConfBaseException

from neocfg.errors import ConfigError, NeocfgError


def dotted(full_key: str) -> str:
    """OmegaConf's `model.tables[0].num_embeddings` -> the override spelling `model.tables.0.num_embeddings`."""
    return re.sub(r"\[(\d+)\]", r".\1", str(full_key)).lstrip(".")


def _first_line(text: str) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return str(text).strip()


def omegaconf_error_to_config_error(exc: Exception) -> ConfigError:
    key = dotted(getattr(exc, "full_key", "") or "")
    value = getattr(exc, "value", None)
    msg = _first_line(getattr(exc, "msg", None) or str(exc))
    if type(exc).__name__ == "MissingMandatoryValue":
        return ConfigError(key, ConfigError.NO_VALUE, "is required but was not given")
    if type(exc).__name__ in ("ConfigKeyError", "ConfigAttributeError"):
        parent = getattr(exc, "object_type_str", None) or "this section"
        return ConfigError(key, ConfigError.NO_VALUE, f"unknown key (not a field of {parent})")
    return ConfigError(key or "<config>", value, msg)


def format_error(exc: BaseException) -> str:
    """One line for any error neocfg reports to a user."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(exc, NeocfgError):
        return str(exc)
    if isinstance(exc, MissingConfigException):
        missing = exc.missing_cfg_file or ""
        options = ", ".join(exc.options or [])
        if "/" in missing and options:
            group, name = missing.rsplit("/", 1)
            return (f"{group.replace('/', '.')}={name}: no such preset in group '{group}'; available: {options}"
                    f" (add your own with --config-dir DIR)")
        return _first_line(str(exc))
    if isinstance(exc, OverrideParseException):
        return f"cannot parse override: {_first_line(str(exc))}"
    cause = exc
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
            err = omegaconf_error_to_config_error(cause)
            return str(err)
        cause = cause.__cause__ or cause.__context__
    return f"{type(exc).__name__}: {_first_line(str(exc))}"
