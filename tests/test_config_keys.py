"""Every config key is read: each key a preset under conf/ sets, and each field of the config schema, is read by
some code of neocfg/ other than the config's own checks.

"Read" is found in the source: an attribute load `x.<name>`, or `<name>` as a string in `.get("<name>")`,
`getattr(x, "<name>")` or a subscript `x["<name>"]`, anywhere in neocfg/ except the config sections' validation
(their `check` methods and the generic finite / unknown-key walks), which look at every key and use none. A key
added to a preset and the schema but read by nothing fails here.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from neocfg.config.schema import NeocfgConfig

REPO = Path(__file__).resolve().parent.parent
# Functions of neocfg/config/ that visit every key without using it.
VALIDATION = {"check", "reject_non_finite", "_reject_unknown_keys"}
# Top-level keys of a conf/ file that are Hydra's, not neocfg's.
HYDRA_KEYS = {"defaults", "hydra"}


def names_read(source: str, skip_functions: frozenset[str] = frozenset()) -> set[str]:
    """Attribute and key names the code reads, outside functions named in skip_functions."""
    found: set[str] = set()

    class Reads(ast.NodeVisitor):
        def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
            if node.name not in skip_functions:
                self.generic_visit(node)

        def visit_Attribute(self, node: ast.Attribute) -> None:
            if isinstance(node.ctx, ast.Load):
                found.add(node.attr)
            self.generic_visit(node)

        def visit_Call(self, node: ast.Call) -> None:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            args = node.args[:1] if name in ("get", "select") else node.args[1:2] if name == "getattr" else []
            found.update(a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str))
            self.generic_visit(node)

        def visit_Subscript(self, node: ast.Subscript) -> None:
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                found.add(node.slice.value)
            self.generic_visit(node)

    Reads().visit(ast.parse(source))
    return found


def neocfg_reads() -> set[str]:
    out: set[str] = set()
    for path in (REPO / "neocfg").rglob("*.py"):
        in_config = path.parent.name == "config"
        out |= names_read(path.read_text(), frozenset(VALIDATION) if in_config else frozenset())
    return out


def _dataclass_of(hint: typing.Any) -> type | None:
    """The config dataclass a field holds (itself, in an Optional or in a List), else None."""
    stack = [hint]
    while stack:
        h = stack.pop()
        if dataclasses.is_dataclass(h):
            return h
        stack += typing.get_args(h)
    return None


def schema_fields(cls: type = NeocfgConfig, prefix: str = "") -> list[tuple[str, str]]:
    """(key path, field name) of every field of the schema, nested sections and list items included."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out.append((prefix + f.name, f.name))
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            out += schema_fields(sub, f"{prefix}{f.name}.")
    return out


def preset_keys(node: typing.Any, cls: type, prefix: str) -> list[tuple[str, str]]:
    """(key path, field name) of every key a preset sets, walking the schema beside it."""
    out = []
    if isinstance(node, list):
        for i, item in enumerate(node):
            out += preset_keys(item, cls, f"{prefix}{i}.")
        return out
    if not isinstance(node, dict):
        return out
    hints = typing.get_type_hints(cls)
    for key, value in node.items():
        assert key in hints, f"{prefix}{key} is not a field of {cls.__name__}"
        out.append((prefix + key, key))
        sub = _dataclass_of(hints[key])
        if sub is not None:
            out += preset_keys(value, sub, f"{prefix}{key}.")
    return out


def presets() -> list[tuple[str, str]]:
    """(file relative to conf/, the schema section it fills) for every preset."""
    conf = REPO / "conf"
    return [(str(p.relative_to(conf)), p.parent.name if p.parent != conf else "")
            for p in sorted(conf.rglob("*.yaml"))]


@pytest.fixture(scope="module")
def reads() -> set[str]:
    return neocfg_reads()


@pytest.mark.parametrize("preset,section", presets())
def test_every_key_a_preset_sets_is_read(reads, preset, section):
    data = {k: v for k, v in (yaml.safe_load((REPO / "conf" / preset).read_text()) or {}).items()
            if k not in HYDRA_KEYS}
    hints = typing.get_type_hints(NeocfgConfig)
    cls = _dataclass_of(hints[section]) if section else NeocfgConfig
    keys = preset_keys(data, cls, f"{section}." if section else "")
    assert keys
    unread = [path for path, name in keys if name not in reads]
    assert not unread, f"conf/{preset} sets keys no code of neocfg/ reads: {unread}"


def test_every_schema_field_is_read(reads):
    unread = [path for path, name in schema_fields() if name not in reads]
    assert not unread, f"config keys no code of neocfg/ reads: {unread}"


def test_a_key_only_validated_is_not_read():
    """The detector itself: a field used only by its section's check() does not count; a use elsewhere does."""
    source = ("class HostConfig:\n"
              "    def check(self, key):\n"
              "        checks.positive(f'{key}.ddr_bandwidth_gbs', self.ddr_bandwidth_gbs)\n"
              "        checks.positive(key, getattr(self, 'cpu_cores'))\n")
    assert not {"ddr_bandwidth_gbs", "cpu_cores"} & names_read(source, frozenset(VALIDATION))
    assert {"ddr_bandwidth_gbs", "cpu_cores"} <= names_read(source)
    used = "def cost(hw):\n    return hw.host.ddr_bandwidth_gbs + cfg['cpu_cores'] + d.get('seed')\n"
    assert {"ddr_bandwidth_gbs", "cpu_cores", "seed"} <= names_read(used, frozenset(VALIDATION))
