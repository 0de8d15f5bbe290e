"""Check a run's delivery log (NEOCFG_DPP_AUDIT) against its dataset: every sample exactly once per epoch.

    python -m neocfg.data.dpp.audit <the NEOCFG_DPP_AUDIT directory> <the dataset directory>

Every rank's client appended each sample it handed to its trainer, as (epoch, sample_id) pairs, to rank<r>.bin
(progress.DeliveryLog). Per epoch this counts the samples delivered, those delivered more than once, and the
dataset's training samples with a label (the rows the label filter keeps) never delivered. The last two epochs may
still be under way when a run stops (ranks fetch ahead, and epochs roll over): they are checked for duplicates
only. Exit 0 when no epoch delivered a sample twice and every earlier epoch delivered every sample; 1 otherwise.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from neocfg.data.dataset import Manifest
from neocfg.data.dpp.progress import DeliveryLog
from neocfg.errors import DataError

# Epochs at the end of a log that may be under way when the run stops: the current one and the one a rank's client
# took splits of ahead.
OPEN_EPOCHS = 2


@dataclass(frozen=True)
class EpochAudit:
    epoch: int
    delivered: int   # samples handed out (repeats included)
    twice: int       # distinct samples handed out more than once
    missing: int     # the dataset's samples not handed out
    open: bool       # may be under way: not expected to be whole

    @property
    def ok(self) -> bool:
        return self.twice == 0 and (self.open or self.missing == 0)


def expected_ids(dataset: Path) -> np.ndarray:
    """The training samples with a label (what the default label filter keeps), sorted."""
    manifest = Manifest.load(dataset)
    parts = []
    for f in manifest.files:
        if f.eval:
            continue
        t = pq.read_table(dataset / f.name, columns=["label", "sample_id"])
        keep = ~np.isnan(t["label"].to_numpy(zero_copy_only=False).astype(np.float64))
        parts.append(t["sample_id"].to_numpy()[keep])
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def audit(log_dir: Path, dataset: Path) -> list[EpochAudit]:
    logs = sorted(log_dir.glob("rank*.bin"))
    if not logs:
        raise DataError(f"{log_dir}: no rank*.bin delivery log (set NEOCFG_DPP_AUDIT={log_dir} in the run's "
                        f"environment)")
    pairs = np.concatenate([DeliveryLog.read(p) for p in logs])
    want = expected_ids(dataset)
    epochs = np.unique(pairs[:, 0])
    out = []
    for e in epochs.tolist():
        ids, counts = np.unique(pairs[pairs[:, 0] == e, 1], return_counts=True)
        out.append(EpochAudit(epoch=e, delivered=int(counts.sum()), twice=int((counts > 1).sum()),
                              missing=int(len(np.setdiff1d(want, ids, assume_unique=True))),
                              open=e > epochs.max() - OPEN_EPOCHS))
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        epochs = audit(Path(args[0]), Path(args[1]))
    except (DataError, OSError) as exc:
        print(f"neocfg: error: {exc}", file=sys.stderr)
        return 2
    for a in epochs:
        state = "under way" if a.open else "whole"
        print(f"epoch {a.epoch}: {a.delivered:,} samples delivered, {a.twice:,} more than once, {a.missing:,} of the "
              f"dataset's never ({state})")
    bad = [a for a in epochs if not a.ok]
    whole = sum(not a.open for a in epochs)
    if bad:
        print(f"NOT exactly once: epoch(s) {', '.join(str(a.epoch) for a in bad)}")
        return 1
    print(f"exactly once: {whole} whole epoch(s) delivered every sample once; no sample twice in any epoch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
