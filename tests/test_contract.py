"""The plan is the contract between the planner and the runtime.

- Import rules (parsed with ast, function-level and TYPE_CHECKING imports included): neocfg/runtime imports nothing
  of neocfg/planner, neocfg/sharding imports neither, and the neocfg packages import each other without a cycle.
- One validator: what plan_check accepts is what the runtime's layout accepts, table by table, for every sharding
  type (an uneven row split included, which both refuse).
- A sharding type lives in one module: a toy type added as one ShardingType member and one module in
  neocfg/sharding/ (in a copy of the package) is planned by the real CLI.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, compose_cfg
from neocfg.errors import DataError
from neocfg.plan import Shard
from neocfg.plan_check import PlanError, check_plan
from neocfg.runtime.layout import build_layout
from neocfg.runtime.plans import rule_plan
from neocfg.types import ShardingType as S

PACKAGE = REPO / "neocfg"


def _unit(module: str) -> str:
    """The package (or top-level module) of neocfg a dotted module name belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "neocfg"


def _module_of(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every neocfg module a file imports, anywhere in it (functions and TYPE_CHECKING blocks too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "neocfg"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "neocfg":       # from neocfg import modes
                out += [(f"neocfg.{a.name}", node.lineno) for a in node.names]
            elif node.module.startswith("neocfg."):
                out.append((node.module, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}:{node.lineno}: relative import (the rules below read absolute ones)")
    return out


def _edges() -> list[tuple[str, str, str]]:
    """(importing module, imported module, file:line) over the whole package."""
    return [(_module_of(p), m, f"{p.relative_to(REPO)}:{line}")
            for p in sorted(PACKAGE.rglob("*.py")) for m, line in _imports(p)]


def test_import_rules_see_imports():
    """The parser finds the imports the rules are about (a rule over no edges could not fail)."""
    edges = _edges()
    assert ("neocfg.planner.costs", "neocfg.sharding") in {(a, b) for a, b, _ in edges}
    assert ("neocfg.runtime.layout", "neocfg.plan_check") in {(a, b) for a, b, _ in edges}
    # a function-level import
    assert ("neocfg.contract", "neocfg.runtime.run") in {(a, b) for a, b, _ in edges}


@pytest.mark.parametrize("importer,forbidden", [("runtime", {"planner"}), ("sharding", {"planner", "runtime"})])
def test_layer_rules(importer, forbidden):
    bad = [f"{where}: {a} imports {b}" for a, b, where in _edges()
           if _unit(a) == importer and _unit(b) in forbidden]
    assert not bad, "\n".join(bad)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def test_no_import_cycle_among_packages():
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for a, b, at in _edges():
        ua, ub = _unit(a), _unit(b)
        if ua != ub:
            graph.setdefault(ua, set()).add(ub)
            where.setdefault((ua, ub), at)
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle) + ": " + "; ".join(where[e] for e in zip(cycle, cycle[1:]))
    # the check itself finds a cycle when there is one
    assert _cycle({**graph, "types": {"planner"}}) is not None


# ---- one validator ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cfg():
    return compose_cfg(["model=dlrm_tiny", "hardware=cpu_local", "train.batch_size=64"])


def _accepts(plan, model) -> tuple[bool, bool]:
    """(plan_check accepts it, the runtime's layout accepts it)."""
    try:
        check_plan(plan, "plan", model, plan.world_size)
        checked = True
    except PlanError:
        checked = False
    try:
        build_layout(plan, model, 0)
        built = True
    except DataError:
        built = False
    return checked, built


def _with_shards(plan, name, shards):
    return dataclasses.replace(plan, tables=tuple(dataclasses.replace(t, shards=tuple(shards)) if t.name == name
                                                  else t for t in plan.tables))


def _variants(plan, name):
    """The table's shards as planned, and moved about: row or column boundaries shifted, ranks swapped or moved, a
    shard held twice."""
    t = plan.table(name)
    shards = list(t.shards)
    yield "as planned", shards
    if len(shards) >= 2:
        a, b = sorted(shards, key=lambda s: (s.row_offset, s.col_offset))[:2]
        if a.num_rows == t.num_embeddings and a.num_cols + b.num_cols <= t.embedding_dim and a.num_cols > 4:
            yield "columns moved", [dataclasses.replace(a, num_cols=a.num_cols - 4),
                                    dataclasses.replace(b, col_offset=b.col_offset - 4, num_cols=b.num_cols + 4),
                                    *[s for s in shards if s not in (a, b)]]
        if a.num_cols == t.embedding_dim and a.num_rows < t.num_embeddings:
            cut = max(1, a.num_rows // 10)      # an uneven row split, e.g. 100/900
            yield "rows moved", [dataclasses.replace(a, num_rows=cut),
                                 dataclasses.replace(b, row_offset=cut, num_rows=a.num_rows + b.num_rows - cut),
                                 *[s for s in shards if s not in (a, b)]]
        yield "ranks swapped", [dataclasses.replace(a, rank=b.rank), dataclasses.replace(b, rank=a.rank),
                                *[s for s in shards if s not in (a, b)]]
    moved = dataclasses.replace(shards[0], rank=(shards[0].rank + 1) % plan.world_size)
    yield "one shard moved", [moved, *shards[1:]]
    yield "one shard doubled", [*shards, moved]


# Variants every sharding type must refuse (not its geometry) or accept; the others only need the two to agree.
VERDICT = {"as planned": True, "columns moved": False, "rows moved": False, "one shard doubled": False}


@pytest.mark.parametrize("world,per_node", [(2, 2), (4, 2)])
@pytest.mark.parametrize("sharding", list(S))
def test_plan_check_and_runtime_agree(cfg, sharding, world, per_node):
    plan = rule_plan(cfg.model, world=world, devices_per_node=per_node, batch_size=64, sharding=sharding)
    seen = set()
    for t in plan.tables[:2]:
        for what, shards in _variants(plan, t.name):
            variant = _with_shards(plan, t.name, shards)
            checked, built = _accepts(variant, cfg.model)
            assert checked == built, (f"{sharding.value} table {t.name}, {what}: plan_check "
                                      f"{'accepts' if checked else 'refuses'}, the runtime "
                                      f"{'accepts' if built else 'refuses'}")
            if what in VERDICT:
                assert checked is VERDICT[what], f"{sharding.value} table {t.name}, {what}: accepted={checked}"
            seen.add(what)
    assert {"as planned", "one shard doubled"} <= seen


def test_uneven_row_split_is_refused_by_mode_plan(cli, cfg, tmp_path):
    """A row-wise table split 100/900 (not the ceil split the runtime routes by) is refused by mode=plan, with the
    file, the table and the geometry named, as mode=train refuses it."""
    plan = rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=64, sharding=S.row_wise)
    t = plan.tables[0]
    cut = t.num_embeddings // 10
    uneven = _with_shards(plan, t.name, [Shard(0, 0, cut, 0, t.embedding_dim),
                                         Shard(1, cut, t.num_embeddings - cut, 0, t.embedding_dim)])
    path = tmp_path / "uneven.json"
    uneven.save(path)
    for mode in ("plan", "train"):
        r = cli(f"mode={mode}", "model=dlrm_tiny", "hardware=cpu_local", "train.batch_size=64", "train.steps=2",
                f"planner.plan_file={path}")
        assert r.returncode != 0, r.stdout
        err = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(err) == 1 and f"table {t.name}" in err[0] and "row_wise's geometry" in err[0], r.stderr
        assert "Traceback" not in r.stderr


# ---- a sharding type in one module -----------------------------------------------------------------------------
TOY_MODULE = '''"""toy_wise: the whole table on one rank, its outputs back by the shared all-to-all, and its ids sent at half
the price (a test's sharding type: one ShardingType member and this module)."""

from __future__ import annotations

import dataclasses

from neocfg.plan import Shard
from neocfg.sharding.base import OutputKind, PieceShape, Routing, Scheme, Spread
from neocfg.types import ShardingType


class ToyWise(Scheme):
    sharding = ShardingType.toy_wise
    routing = Routing.whole_table
    kind = OutputKind.all_to_all
    spread = Spread.one
    abbrev = "TOY"

    def shards(self, rows, dim, ranks):
        return (Shard(ranks[0], 0, rows, 0, dim),)

    def piece_shape(self, cost, table, num_pieces):
        g = cost.global_batch
        return PieceShape(rows=table.num_embeddings, cols=table.embedding_dim,
                          lookup_rows=g * table.pooling_factor, output_samples=g)

    def piece_comms(self, traffic, shape, pooling, kind=None, share=1.0):
        ids, *outputs = super().piece_comms(traffic, shape, pooling, kind, share)   # (routing's, output kind's)
        return (dataclasses.replace(ids, held_received=ids.held_received / 2, each_sent=ids.each_sent / 2), *outputs)
'''


def _toy_package(root: Path) -> Path:
    """A copy of the repository's package and conf/ with the toy type added: one enum member, one module."""
    shutil.copytree(PACKAGE, root / "neocfg", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "conf", root / "conf")
    types_py = root / "neocfg" / "types.py"
    text = types_py.read_text()
    anchor = '    data_parallel = "data_parallel"\n'
    assert text.count(anchor) == 1
    types_py.write_text(text.replace(anchor, anchor + '    toy_wise = "toy_wise"\n'))
    (root / "neocfg" / "sharding" / "toy_wise.py").write_text(TOY_MODULE)
    return root


def test_toy_sharding_type_is_planned(tmp_path):
    root = _toy_package(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k != "NEOCFG_DEBUG"}
    env["PYTHONPATH"] = str(root)
    where = subprocess.run([sys.executable, "-c", "import neocfg; print(neocfg.__file__)"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where == str(root / "neocfg" / "__init__.py")
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "neocfg", "mode=plan", "model=dlrm_tiny", "hardware=cpu_local",
                        "planner.sharding_types=[toy_wise]", f"hydra.run.dir={out}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert {t["sharding"] for t in plan["tables"]} == {"toy_wise"}, [t["sharding"] for t in plan["tables"]]
    assert "TOY" in r.stdout
    # ... and the plan it wrote is one the copy's own validator accepts
    check = subprocess.run([sys.executable, "-c", "from neocfg.plan_check import load_plan_file; "
                            f"load_plan_file({str(out / 'plan.json')!r}); print('ok')"],
                           env=env, cwd=tmp_path, capture_output=True, text=True)
    assert check.stdout.strip() == "ok", check.stderr
