"""Turn Hydra / OmegaConf / neocfg exceptions into one readable line naming the key, the value and what is allowed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import yaml
from omegaconf import ListConfig
from omegaconf.errors import OmegaConfBaseException

from neocfg.errors import ConfigError, NeocfgError


# Hydra's launcher plugins by the name of their config (hydra/launcher=<name>) -> the package that provides it.
LAUNCHER_PACKAGES = {"joblib": "hydra-joblib-launcher", "ray": "hydra-ray-launcher", "ray_aws": "hydra-ray-launcher",
                     "submitit_local": "hydra-submitit-launcher", "submitit_slurm": "hydra-submitit-launcher",
                     "rq": "hydra-rq-launcher"}


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


def _omegaconf_cause(exc: BaseException) -> Optional[OmegaConfBaseException]:
    cause: Optional[BaseException] = exc
    while cause is not None:
        if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def _yaml_cause(exc: BaseException) -> Optional[yaml.MarkedYAMLError]:
    cause: Optional[BaseException] = exc
    while cause is not None:
        if isinstance(cause, yaml.MarkedYAMLError) and cause.problem_mark is not None:
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def _yaml_syntax(err: yaml.MarkedYAMLError) -> str:
    mark = err.problem_mark
    what = " ".join(x for x in (err.problem, f"({err.context})" if err.context else "") if x)
    return f"{mark.name}:{mark.line + 1}: YAML syntax error: {what or 'cannot parse'}"


def _no_such_list_entry(cause: OmegaConfBaseException) -> Optional[str]:
    """`model.tables.99.num_embeddings=5` on a model with 8 tables: OmegaConf says 'dict is not a subclass of'."""
    parent, key = getattr(cause, "parent_node", None), getattr(cause, "key", None)
    made_up = "is not a subclass of" in str(getattr(cause, "msg", "") or cause)  # an empty dict for the new index
    if made_up and isinstance(parent, ListConfig) and isinstance(key, int) and key >= len(parent) > 0:
        path = dotted(cause.full_key).rsplit(".", 1)[0]
        return (f"{path}.{key}: no such entry: {path} has {len(parent)} (indices 0-{len(parent) - 1}); change an"
                f" existing one by its index, or add entries in a preset of your own (--config-dir)")
    return None


def _walk(node: yaml.Node, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], yaml.Node, yaml.Node]]:
    """(path, key node, value node) of every mapping entry in a composed YAML tree."""
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            sub = (*path, str(k.value))
            yield sub, k, v
            yield from _walk(v, sub)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            yield from _walk(v, (*path, str(i)))


def _locate_in_preset(text: str, exc: BaseException, search_dirs: Sequence[Path]) -> Optional[str]:
    """Hydra's "In 'dsi/bad': ValidationError raised while composing config" names the preset but neither the
    file, the line nor the key path: find the offending key (and value) in the preset file."""
    m = re.search(r"In '([\w./-]+)': (\w+) raised while composing config", text)
    cause = _omegaconf_cause(exc)
    if m is None or cause is None:
        return None
    name = m.group(1)
    files = [d / f"{name}.yaml" for d in search_dirs if (d / f"{name}.yaml").is_file()]
    if not files:
        return None
    try:
        tree = yaml.compose(files[0].read_text())
    except yaml.YAMLError:
        return None
    key = str(getattr(cause, "key", "") or "")
    value = getattr(cause, "value", None)
    want = dotted(cause.full_key)
    hits = [(p, k, v) for p, k, v in _walk(tree, ()) if p[-1] == key]
    if value is not None:
        hits = [h for h in hits if isinstance(h[2], yaml.ScalarNode) and h[2].value == str(value)] or hits
    hits.sort(key=lambda h: not ".".join(h[0]).endswith(want))
    if not hits:
        return None
    path, knode, _ = hits[0]
    group = name.split("/")[0] if "/" in name else ""
    full = ".".join(x for x in (group, *path) if x)
    err = omegaconf_error_to_config_error(cause)
    if type(cause).__name__ in ("ConfigKeyError", "ConfigAttributeError"):
        parent = getattr(cause, "object_type_str", None) or "this section"
        detail = f"{full}: unknown key (not a field of {parent})"
    else:
        detail = f"{full}={value!r} is invalid: {err.allowed}"
    return f"{files[0]}:{knode.start_mark.line + 1}: {detail}"


def _locate_in_override(text: str, exc: BaseException) -> Optional[str]:
    """"Error merging override +dsi.transforms=[{column:x,op:frobnicate}]": the key path inside the value."""
    m = re.search(r"Error merging override (\S+)", text)
    cause = _omegaconf_cause(exc)
    if m is None or cause is None or "." in dotted(cause.full_key):
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_override(m.group(1))
        value = override.value()
    except Exception:  # noqa: BLE001 - best effort: fall back to the plain message
        return None
    key, bad = str(getattr(cause, "key", "")), getattr(cause, "value", None)

    def find(node: Any, path: tuple[str, ...]) -> Optional[tuple[str, ...]]:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
        for k, v in items:
            if str(k) == key and (bad is None or str(v) == str(bad)):
                return (*path, str(k))
            found = find(v, (*path, str(k)))
            if found:
                return found
        return None

    inner = find(value, ())
    if inner is None:
        return None
    err = omegaconf_error_to_config_error(cause)
    full = ".".join((override.key_or_group, *inner))
    if err.value is ConfigError.NO_VALUE:
        return f"{full}: {err.allowed}"
    return str(ConfigError(full, err.value, err.allowed))


def format_error(exc: BaseException, search_dirs: Sequence[Path] = ()) -> str:
    """One line for any error neocfg reports to a user. search_dirs: the config directories (--config-dir first,
    then the package's conf/) in which a preset named by Hydra is looked up for its file and line."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(exc, NeocfgError):
        return str(exc)
    syntax = _yaml_cause(exc)
    if syntax is not None:
        return _yaml_syntax(syntax)
    text = str(exc)
    located = _locate_in_preset(text, exc, search_dirs) or _locate_in_override(text, exc)
    if located:
        return located
    cause = _omegaconf_cause(exc)
    if cause is not None:
        entry = _no_such_list_entry(cause)
        if entry:
            return entry
    if isinstance(exc, MissingConfigException):
        missing = exc.missing_cfg_file or ""
        options = ", ".join(exc.options or [])
        if "/" in missing and options:
            group, name = missing.rsplit("/", 1)
            package = LAUNCHER_PACKAGES.get(name) if group == "hydra/launcher" else None
            if package is not None:
                return (f"hydra/launcher={name}: the launcher plugin is not installed; pip install {package} (or"
                        f" neocfg's extra: pip install 'neocfg[launchers]'); installed launchers: {options}")
            return (f"{group.replace('/', '.')}={name}: no such preset in group '{group}'; available: {options}"
                    f" (add your own with --config-dir DIR)")
        return _first_line(str(exc))
    if isinstance(exc, OverrideParseException):
        return f"cannot parse override: {_first_line(str(exc))}"
    if cause is not None:
        return str(omegaconf_error_to_config_error(cause))
    return f"{type(exc).__name__}: {_first_line(str(exc))}"
