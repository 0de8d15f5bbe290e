"""`python -m neocfg.data.dpp.audit`: a run's delivery log (NEOCFG_DPP_AUDIT) checked against its dataset."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from neocfg.data.dpp.audit import audit, main
from neocfg.data.dpp.progress import DeliveryLog
from data_helpers import labeled_ids, make_dataset


def _log(path: Path, batches: list[tuple[int, np.ndarray]]) -> None:
    log = DeliveryLog(path)
    for epoch, ids in batches:
        log.write(epoch, ids)
    log.close()


def _epochs(ids: np.ndarray, n: int, cut: int) -> list[tuple[int, np.ndarray]]:
    """n whole epochs over two ranks' logs' worth of ids, then a partial one of `cut` samples."""
    return [(e, ids) for e in range(n)] + [(n, ids[:cut])]


def test_whole_epochs_pass_and_a_sample_twice_or_missing_fails(tmp_path, capsys):
    cfg = make_dataset(tmp_path / "ds")
    ds = Path(cfg.dsi.path)
    ids = np.array(sorted(labeled_ids(ds)), dtype=np.int64)
    half = len(ids) // 2
    good = tmp_path / "good"
    _log(good / "rank0.bin", _epochs(ids[:half], 3, 10))
    _log(good / "rank1.bin", _epochs(ids[half:], 3, 5))
    assert main([str(good), str(ds)]) == 0
    out = capsys.readouterr().out
    assert "exactly once: 2 whole epoch(s)" in out and "epoch 3: 15 samples delivered" in out
    assert [a.open for a in audit(good, ds)] == [False, False, True, True]

    twice = tmp_path / "twice"
    _log(twice / "rank0.bin", _epochs(ids[:half], 3, 10))
    _log(twice / "rank1.bin", _epochs(ids[half - 1:], 3, 5))  # one sample in both ranks' every epoch
    assert main([str(twice), str(ds)]) == 1
    assert "NOT exactly once: epoch(s) 0, 1, 2\n" in capsys.readouterr().out

    lost = tmp_path / "lost"
    _log(lost / "rank0.bin", [(0, ids[:half]), (1, ids[:half]), (2, ids[:3])])
    _log(lost / "rank1.bin", [(0, ids[half + 1:]), (1, ids[half:])])  # epoch 0 misses one sample
    got = audit(lost, ds)
    assert (got[0].missing, got[0].ok, got[1].ok) == (1, False, True)
    assert main([str(lost), str(ds)]) == 1


def test_no_log_is_one_line_and_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "neocfg.data.dpp.audit", str(tmp_path), str(tmp_path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"neocfg: error: {tmp_path}: no rank*.bin delivery log (set NEOCFG_DPP_AUDIT={tmp_path} " \
                               "in the run's environment)"
