"""bench/bench_vs_torchrec.py --whole-run --record-from: the whole-run table from the --out files of separate
invocations (one case each, short enough for the CPU lock)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _bench():
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("bench_vs_torchrec", REPO / "bench" / "bench_vs_torchrec.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _out(tmp_path: Path, name: str, model: str, sharding: str, steps: int, runs: dict, repeats: int = 2) -> str:
    best = {n: max(v) for n, v in runs.items()}
    case = {"model": model, "ids": "uniform", "sharding": sharding, "best_samples_per_s": best,
            "ratio_cycled": best["neocfg_cycled"] / best["torchrec"],
            "ratio_stream": best["neocfg_stream"] / best["torchrec"],
            "runs": {n: [{"samples_per_s": x} for x in v] for n, v in runs.items()}}
    path = tmp_path / name
    path.write_text(json.dumps({"bench": "neocfg_vs_torchrec_whole_runs", "world": 2, "batch_per_rank": 512,
                                "steps": steps, "repeats": repeats, "cycled_batches": 8, "cases": [case]}))
    return str(path)


def test_record_from_merges_the_cases_of_several_files_in_order(tmp_path, monkeypatch):
    bench = _bench()
    recorded = []
    monkeypatch.setattr(bench, "record_results", lambda section, body: recorded.append((section, body)))
    note = "Recorded beside other work."
    a = _out(tmp_path, "a.json", "criteo", "table_wise", 400,
             {"neocfg_cycled": [30000, 36000], "neocfg_stream": [31000, 29000], "torchrec": [27000, 24000]})
    b = _out(tmp_path, "b.json", "tiny8", "row_wise", 800,
             {"neocfg_cycled": [100000, 90000], "neocfg_stream": [95000, 99000], "torchrec": [80000, 85000]})
    bench.record_whole_runs([a, b], note)
    (section, body), = recorded
    assert section == bench.WHOLE_RUN_SECTION and note in body
    assert "criteo 400, tiny8 800 steps per run" in body and "best of 2" in body
    rows = [line for line in body.splitlines() if line.startswith("| criteo") or line.startswith("| tiny8")]
    assert rows[0] == "| criteo | uniform | table_wise | 36,000 | 31,000 | 27,000 | 1.33x | 1.15x | >= 1.3x |"
    assert rows[1] == "| tiny8 | uniform | row_wise | 100,000 | 99,000 | 85,000 | 1.18x | 1.16x | >= 1.0x |"
    # every run, in the second table
    assert rows[2] == "| criteo | uniform | table_wise | 30,000, 36,000 | 31,000, 29,000 | 27,000, 24,000 |"
    # a section of its own (models neither system was tuned on), named by --section
    bench.record_whole_runs([a], section="Other models")
    assert recorded[-1][0] == "Other models"


def test_record_from_refuses_files_of_another_bench_or_mixed_repeats(tmp_path, monkeypatch):
    bench = _bench()
    monkeypatch.setattr(bench, "record_results", lambda section, body: None)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"bench": "something_else", "cases": []}))
    with pytest.raises(SystemExit, match="other.json: not a --whole-run --out file"):
        bench.record_whole_runs([str(other)])
    runs = {"neocfg_cycled": [1.0], "neocfg_stream": [1.0], "torchrec": [1.0]}
    two = _out(tmp_path, "two.json", "criteo", "table_wise", 400, runs, repeats=2)
    three = _out(tmp_path, "three.json", "tiny8", "table_wise", 800, runs, repeats=3)
    with pytest.raises(SystemExit, match=r"different --repeats \(\[2, 3\]\)"):
        bench.record_whole_runs([two, three])


def test_a_preset_model_spec_caps_rows_and_sets_one_dim():
    """--models PRESET@ROWS:dim=D: the preset's tables capped, every table and the bottom MLP's last layer at D (what
    TorchRec's DLRM needs), uniform ids zeroing every table's skew; bad specs exit naming the part and what is
    allowed."""
    bench = _bench()
    cfg = bench.neocfg_config("criteo_tb_mlperf_v1@100000:dim=32", 512, 10, "table_wise", ids="uniform")
    tables = cfg.model.tables
    assert len(tables) == 26
    assert max(t.num_embeddings for t in tables) == 100_000 and min(t.num_embeddings for t in tables) < 100_000
    assert {t.embedding_dim for t in tables} == {32} and cfg.model.bottom_layers[-1] == 32
    assert all(t.alpha == 0 for t in tables)
    assert bench.neocfg_config("dlrm_tiny@500", 512, 10, None).model.tables[0].embedding_dim == 16
    for bad, says in [("nope@10", "unknown preset 'nope'"), ("dlrm_tiny@x", "row cap 'x'"),
                      ("dlrm_tiny@10:width=3", "unknown option 'width=3'")]:
        with pytest.raises(SystemExit, match=says):
            bench.model_overrides(bad)
