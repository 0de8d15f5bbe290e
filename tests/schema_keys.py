"""Every key of the config schema as a dotted path with its type and default (docs/configuration.md is checked against it).

A list of sections (model.tables, dsi.transforms, dsi.worker_shapes) is written `key[].field`.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass

from omegaconf import MISSING

from neocfg.config.schema import NeocfgConfig

REQUIRED = "required"
UNSET = "unset"


@dataclass(frozen=True)
class Key:
    path: str
    type_name: str
    default: str           # as docs/configuration.md writes it: `required`, `unset`, a YAML scalar or flow list


def schema_keys(cls: type = NeocfgConfig, prefix: str = "") -> list[Key]:
    """The leaf keys under `cls` in field order (sections themselves are not keys)."""
    hints = typing.get_type_hints(cls)
    out: list[Key] = []
    for f in dataclasses.fields(cls):
        path, hint = prefix + f.name, hints[f.name]
        section = _section_of(hint)
        if section is not None:
            out += schema_keys(section, path + ("[]." if _is_list(hint) else "."))
        else:
            out.append(Key(path, _type_name(hint), _render_default(f)))
    return out


def _section_of(hint: object) -> type | None:
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    for arg in typing.get_args(hint):
        found = _section_of(arg)
        if found is not None:
            return found
    return None


def _is_list(hint: object) -> bool:
    if typing.get_origin(hint) in (list, typing.List):
        return True
    return any(_is_list(a) for a in typing.get_args(hint))


def _type_name(hint: object) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union:
        return _type_name(args[0]) if len(args) == 1 else " | ".join(_type_name(a) for a in args)
    if typing.get_origin(hint) in (list, typing.List):
        return f"list[{_type_name(args[0])}]"
    if typing.get_origin(hint) in (dict, typing.Dict):
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]"
    if hint is typing.Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def _render_default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return REQUIRED
    return render(value)


def render(value: object) -> str:
    if value is MISSING or value == MISSING:
        return REQUIRED
    if value is None:
        return UNSET
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render(v) for v in value) + "]"
    return str(value)
