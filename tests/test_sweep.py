"""Issue 5: multirun sweeps end with sweep_summary.{csv,md,png}; a run that fails is a row saying why."""

from __future__ import annotations

import csv
from pathlib import Path


def _sweep_dir(tmp_path: Path) -> Path:
    dirs = [p.parent for p in (tmp_path / "multirun").rglob("multirun.yaml")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def _rows(sweep_dir: Path) -> list[dict[str, str]]:
    with open(sweep_dir / "sweep_summary.csv") as f:
        return list(csv.DictReader(f))


def test_describe_sweep_with_a_bad_run_is_summarized(cli, tmp_path):
    r = cli("-m", "mode=describe", "hardware=zionex_1node", "hardware.nodes=1,0,2")
    assert r.returncode == 0, r.stderr
    sweep = _sweep_dir(tmp_path)
    for name in ("sweep_summary.csv", "sweep_summary.md", "sweep_summary.png"):
        assert (sweep / name).stat().st_size > 0
    rows = _rows(sweep)
    assert [row["hardware.nodes"] for row in rows] == ["1", "0", "2"]
    assert [row["fits"] for row in rows] == ["yes", "no", "yes"]
    assert "hardware.nodes=0 is invalid: must be > 0" in rows[1]["why"]
    assert "hardware" not in rows[0]  # not swept: the same in every run
    md = (sweep / "sweep_summary.md").read_text()
    assert md.startswith("| job | hardware.nodes | fits | why |")
