"""A synthetic file in Criteo's exact line format, for trying the Criteo path without the real data (and for tests).

    python -m neocfg.data.criteo_sample --rows 200000 --out data/criteo_sample/train.txt [--gzip] [--seed 0]

Lines are `label<TAB>13 integers<TAB>26 hex ids`, an empty field where a value is missing, like the Kaggle
train.txt and the 1TB day files. The integers are heavy-tailed counts (int_1 also takes Criteo's small negatives),
the ids Zipf-skewed over a per-column set of random 32-bit values (8 hex digits), and the label is drawn from a
hidden logistic function of both, so a model can learn it: a trained DLRM's AUC says how much of it it found. It is
not Criteo's data: any number measured on it is about this generator.
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

import numpy as np

from neocfg.data.criteo import CAT_FEATURES, INT_FEATURES

# Ids per categorical column: a spread like Criteo's (a handful to ~1e5 here, to keep the sample small).
CARDINALITIES = (1460, 583, 100_000, 50_000, 305, 24, 12_517, 633, 3, 20_000, 5_683, 80_000, 3_194, 27, 14_992,
                 60_000, 10, 5_652, 2_173, 4, 70_000, 18, 15, 30_000, 105, 40_000)
# Fraction of values missing per column kind (Criteo's integer columns miss 0-45 %, its ids 0-44 %).
MISSING_INT, MISSING_CAT = 0.2, 0.1
# Zipf exponent of id popularity.
ZIPF_S = 1.1
# Mean click rate (Criteo Kaggle's train.txt: 25.6 % positives).
BASE_CTR = 0.256


def sample_lines(rows: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    ints = np.floor(rng.lognormal(1.0, 1.5, (rows, INT_FEATURES))).astype(np.int64)
    ints[:, 1] -= rng.integers(0, 4, rows) * (rng.random(rows) < 0.1)  # int_1 takes -1..-3 like Criteo's I2
    int_missing = rng.random((rows, INT_FEATURES)) < MISSING_INT
    weights = rng.normal(0.0, 0.35, INT_FEATURES)
    logit = np.log(BASE_CTR / (1 - BASE_CTR)) + (np.log1p(np.maximum(ints, 0)) - 1.2) * ~int_missing @ weights
    cat_text = []
    cat_missing = rng.random((rows, CAT_FEATURES)) < MISSING_CAT
    for k, n in enumerate(CARDINALITIES):
        values = rng.choice(1 << 32, n, replace=False)
        p = 1.0 / np.arange(1, n + 1) ** ZIPF_S
        idx = rng.choice(n, rows, p=p / p.sum())
        effect = rng.normal(0.0, 1.0 if k % 3 == 0 else 0.3, n)  # every third column carries most of the signal
        logit += np.where(cat_missing[:, k], 0.0, effect[idx])
        cat_text.append(np.where(cat_missing[:, k], "", np.char.mod("%08x", values[idx])))
    labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)
    int_text = [np.where(int_missing[:, j], "", ints[:, j].astype(str)) for j in range(INT_FEATURES)]
    columns = [labels.astype(str), *int_text, *cat_text]
    return ["\t".join(fields) for fields in zip(*columns)]


def write(path: Path, rows: int, seed: int = 0, gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(sample_lines(rows, seed)) + "\n"
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gzip", action="store_true", help="gzip the file (as the 1TB day_N.gz)")
    a = ap.parse_args()
    write(a.out, a.rows, a.seed, a.gzip)
    print(f"wrote {a.rows:,} synthetic Criteo-format lines to {a.out}")


if __name__ == "__main__":
    main()
