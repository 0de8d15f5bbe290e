"""Issues 4 and 10: dsi.workers=auto takes the planner's DPP sizing (hosts of a worker shape), handed to the data
layer by the runtime, turned into local processes per rank or Ray actors for the job; a fixed count overrides it
and is capped with a warning. The data layer neither imports the planner nor has an import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

from neocfg.data.dpp.sizing import PlannedDpp, WorkerCountSource, worker_count, workers_needed
from neocfg.plan import DppSizing
from neocfg.types import DppBackendKind
from conftest import compose_cfg

REPO = Path(__file__).resolve().parent.parent


def _sizing(hosts: int, cfg) -> PlannedDpp:
    dpp = DppSizing(workers=hosts, workers_per_trainer_node=hosts, bottleneck="cpu", demand_samples_per_s=1.0,
                    capacity_samples_per_s=1.0, workers_by_shape={cfg.dsi.worker_shapes[0].name: hosts})
    return PlannedDpp.from_plan(dpp, cfg.dsi)


def test_fixed_count_overrides_and_is_capped_with_a_warning():
    cfg = compose_cfg(["dsi=parquet_local", "dsi.workers=5"])
    wc = worker_count(cfg.dsi, world_size=2, sizing=_sizing(40, cfg), cpus=2)
    assert (wc.total, wc.per_service, wc.source, wc.warning) == (5, 3, WorkerCountSource.fixed, "")
    cfg = compose_cfg(["dsi=parquet_local", "dsi.workers=100"])
    wc = worker_count(cfg.dsi, world_size=2, cpus=2)
    assert wc.per_service == 16
    assert wc.warning == ("warning: dsi.workers=100 asks for 50 worker processes per rank (100 over 2 ranks); "
                          "capped at dsi.max_workers=16")


def test_auto_turns_planned_hosts_into_local_processes_or_ray_actors():
    cfg = compose_cfg(["dsi=parquet_local", "dsi.max_workers=4"])
    sizing = _sizing(2, cfg)  # 2 x cpu_host_64c
    assert sizing.cores_per_host == 64 and sizing.memory_gib_per_host == 256
    wc = worker_count(cfg.dsi, world_size=2, sizing=sizing, backend=DppBackendKind.local, cpus=64)
    assert (wc.total, wc.per_service, wc.source) == (128, 4, WorkerCountSource.planner)
    assert "128 cores -> 64 local worker processes per rank" in wc.note, wc.note and "dsi.max_workers=4" in wc.note
    assert wc.warning == ""  # auto never warns: it is the planner's count, fitted to this machine
    wc = worker_count(cfg.dsi, world_size=2, sizing=sizing, backend=DppBackendKind.local, cpus=2)
    assert wc.per_service == 1 and "hardware.host.cpu_cores=2 for 2 ranks per host" in wc.note and wc.warning == ""
    # 4 ranks on 2 hosts of 4 cores: each host's 2 ranks share its 4 cores
    wc = worker_count(cfg.dsi, world_size=4, sizing=sizing, backend=DppBackendKind.local, cpus=4, ranks_per_host=2)
    assert wc.per_service == 2 and "cpu_cores=4 for 2 ranks per host" in wc.note
    wc = worker_count(cfg.dsi, world_size=2, sizing=sizing, backend=DppBackendKind.ray, cpus=2)
    assert (wc.total, wc.per_service) == (2, 2) and "2 Ray worker actor(s) of 64 CPUs each" in wc.note


def test_auto_without_a_sizing_estimates():
    cfg = compose_cfg(["dsi=parquet_local"])
    wc = worker_count(cfg.dsi, world_size=2, cpus=2)
    assert wc.source is WorkerCountSource.estimate and (wc.total, wc.per_service) == (3, 2)


def test_workers_needed():
    assert workers_needed(1500.0, 1000.0, 0.2) == 2
    assert workers_needed(1000.0, 1000.0, 0.0) == 1
    assert workers_needed(1.0, 1000.0, 0.2) == 1


def _imports(path: Path, package: str) -> set[str]:
    """Modules of neocfg imported by a file (absolute and relative, at any depth of the file)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
    return {m for m in out if m.startswith("neocfg")}


def test_data_layer_has_no_planner_import_and_dpp_no_import_cycle():
    data = REPO / "neocfg" / "data"
    for f in data.rglob("*.py"):
        bad = [m for m in _imports(f, "neocfg.data") if m == "neocfg.planner" or m.startswith("neocfg.planner.")]
        assert not bad, f"{f.relative_to(REPO)} imports {bad}"
    dpp = data / "dpp"
    graph = {f"neocfg.data.dpp.{f.stem}": {m for m in _imports(f, "neocfg.data.dpp") if m.startswith("neocfg.data.dpp.")}
             for f in dpp.glob("*.py") if f.stem != "__init__"}

    def cycle_from(node: str, path: list[str]) -> list[str]:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            found = cycle_from(nxt, path + [nxt])
            if found:
                return found
        return []

    for module in graph:
        assert not cycle_from(module, [module]), f"import cycle: {' -> '.join(cycle_from(module, [module]))}"
