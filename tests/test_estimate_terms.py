"""bench/estimate_terms.py's summary: each term's worst run per kind and sharding, and runs of separate invocations
merged into one numbered list."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _bench():
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("estimate_terms", REPO / "bench" / "estimate_terms.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("estimate_terms", module)   # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _run(kind: str, sharding: str, run: int, terms: dict[str, tuple[float, float]], step: float = 10.0) -> dict:
    bench = _bench()
    rows = [{"term": name, "predicted_ms": p, "measured_ms": m, "ratio": p / m, "share": m / step,
             "verdict": bench.verdict(p, m, step, 0.05, 0.25)} for name, (p, m) in terms.items()]
    return {"kind": kind, "sharding": sharding, "run": run, "steps": 5, "laps": "", "terms": rows}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split("|")]


def test_summary_keeps_the_run_farthest_from_its_measurement_and_names_the_terms_outside():
    bench = _bench()
    runs = [_run("small", "table_wise", 1, {"embedding_compute": (1.1, 1.0), "embedding_comm": (3.0, 3.1),
                                            "dense": (2.0, 2.1), "data": (0.1, 0.2), "step": (6.2, 6.4)}),
            _run("small", "table_wise", 2, {"embedding_compute": (0.7, 1.0), "embedding_comm": (3.2, 3.0),
                                            "dense": (2.0, 2.5), "data": (0.1, 0.3), "step": (6.0, 6.8)})]
    header, _, row = bench.summary(runs).splitlines()
    cells = dict(zip(_cells(header), _cells(row)))
    # compute: 1.10 (ok) and 0.70 (outside): the second is farther from 1
    assert cells["embedding_compute"] == "0.70 MISS"
    assert cells["embedding_comm"] == "1.07"
    assert cells["dense"] == "0.80"
    assert cells["data"] == "small"   # under 5 % of the step in both runs
    assert cells["runs"] == "2"
    assert cells["verdict"] == "outside: embedding_compute"


def test_merge_numbers_the_runs_of_separate_invocations(tmp_path):
    one = [_run("small", "row_wise", 1, {"dense": (2.0, 2.0), "step": (5.0, 5.0)})]
    files = []
    for i in range(2):
        f = tmp_path / f"part{i}.json"
        f.write_text(json.dumps({"results": one}))
        files.append(str(f))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "estimate_terms.py"), "--merge", *files],
                         capture_output=True, text=True, check=True).stdout
    assert "**small, row_wise, run 1**" in out and "**small, row_wise, run 2**" in out
    summary_row = next(line for line in out.splitlines() if line.startswith("| small | row_wise |"))
    assert _cells(summary_row)[2] == "2"


def test_a_busy_process_beside_the_run_marks_it_disturbed():
    """CpuClock counts the machine's busy CPU time less what the measured children took: a process still running
    beside a quiet child (not waited for: not ours) shows as others' share of the cores; the child's own time does
    not."""
    bench = _bench()
    burn = [sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5: pass"]
    start = bench.CpuClock.now()
    beside = subprocess.Popen(burn)
    subprocess.run([sys.executable, "-c", "import time; time.sleep(1.0)"], check=True)
    end = bench.CpuClock.now()
    beside.kill()
    beside.wait()
    assert end.others_since(start) >= 0.2
    # the arithmetic: 3 s busy of which 1 s ours, 0.5 s stolen, over 2 s of wall on the machine's cores
    a, b = bench.CpuClock(10.0, 0.0, 1.0, 0.0), bench.CpuClock(13.0, 0.5, 2.0, 2.0)
    assert b.others_since(a) == (3.0 - 1.0 + 0.5) / (2.0 * (__import__("os").cpu_count() or 1))


def test_each_run_heading_gives_the_machines_speed_just_before_it():
    """probe() times a fixed workload (one-thread products, a round trip to another process, a gather of random rows
    from memory); the run's heading in the record shows it, so two runs of one kind that differ in every lap can be
    told apart by the machine. Records made before the gather was probed still read."""
    bench = _bench()
    speed = bench.probe()
    assert speed["matmul_ms"] > 0 and speed["handoff_us"] > 0 and speed["gather_ms"] > 0
    run = {**_run("small", "table_wise", 1, {"dense": (2.0, 2.0), "step": (5.0, 5.0)}), "others": 0.01,
           "probe": {"matmul_ms": 41.2, "handoff_us": 9.6, "gather_ms": 52.4}}
    assert ("other processes 1 % of the cores; machine probe: matmul 41 ms, handoff 10 us, gather 52 ms"
            in bench.markdown([run]))
    older = {**run, "probe": {"matmul_ms": 41.2, "handoff_us": 9.6}}
    assert "machine probe: matmul 41 ms, handoff 10 us; laps" in bench.markdown([older])


def test_summary_puts_a_kinds_shardings_side_by_side_and_names_where_a_term_is_outside():
    bench = _bench()
    runs = [_run("criteo", "table_wise", 1, {"embedding_compute": (1.0, 1.0), "dense": (2.0, 2.1)}),
            _run("criteo", "row_wise", 1, {"embedding_compute": (1.5, 1.0), "dense": (2.0, 2.5)}),
            _run("small", "table_wise", 1, {"embedding_compute": (1.0, 1.1), "dense": (2.0, 2.0)})]
    header, _, criteo, small = bench.summary(runs).splitlines()
    cells = dict(zip(_cells(header), _cells(criteo)))
    assert cells["sharding"] == "table_wise / row_wise"
    assert cells["runs"] == "1 / 1"
    assert cells["embedding_compute"] == "1.00 / 1.50 MISS"
    assert cells["dense"] == "0.95 / 0.80"
    assert cells["verdict"] == "outside: embedding_compute (row_wise)"
    assert dict(zip(_cells(header), _cells(small)))["verdict"] == "every term within"
