"""Issues 4 and 10: bench/bench_dpp.py runs end to end (tiny sizes: projection, scaling, stall, autoscaling; the
local vs Ray part is left out here, tests/test_data_ray.py covers the Ray backend) and writes its JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_dpp_smoke(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_dpp.py"), "--samples", "8000", "--reps", "1",
                        "--epochs", "1", "--stall-seconds", "1", "--split-cost-s", "0.02", "--autoscale-seconds", "3",
                        "--no-ray", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "speed-up x" in r.stdout and "scaling" in r.stdout and "stall" in r.stdout
    res = json.loads(out.read_text())
    assert res["projection"]["bytes_ratio"] > 2
    assert {"too_few", "planned"} <= set(res["stall"]) and res["scaling"]["ratio"] > 0
    assert "autoscale (" in r.stdout
    assert res["autoscale"]["windows"] and (tmp_path / "bench_autoscale.png").stat().st_size > 0
