"""Through the real CLI: bad input and faults end in one line with a reason and a distinct exit code, no
traceback, nothing half-written; killed or interrupted runs leave no orphan rank and no lost checkpoint; resume
falls back to the newest valid checkpoint; advice in messages has been verified; sweeps fail when every run fails.

Lean by design: one reference training run (dlrm_tiny, batch 32, 9 steps, a checkpoint every 3) is shared by the
whole module; the fault runs hang a rank on purpose (NEOCFG_FAULT_KILL=1:7:hang) so that signals arrive at a known
point instead of racing a fast run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from conftest import compose_cfg, run_cli
from runtime_helpers import assert_same_rank_state
from neocfg.runtime.plans import rule_plan
from neocfg.runtime.train import FAULT_ENV
from neocfg.types import ShardingType

STEPS, EVERY = 9, 3
# rank 1 stops responding after step 7: the checkpoint of step 6 is complete, the run hangs until signalled
HANG = {FAULT_ENV: "1:7:hang"}


def _args(plan: Path, ckpt: Path, *extra: str) -> list[str]:
    return ["mode=train", "train.batch_size=32", f"train.steps={STEPS}", "train.eval_batches=1", "train.log_every=3",
            f"train.checkpoint_every={EVERY}", f"planner.plan_file={plan}", f"train.checkpoint_dir={ckpt}",
            "train.collective_timeout_s=120", *extra]


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict[str, Path]:
    """One uninterrupted run: its plan file and its checkpoint directory (steps 6 and 9)."""
    root = tmp_path_factory.mktemp("ref")
    cfg = compose_cfg(["mode=train", "train.batch_size=32"])
    plan = root / "plan.json"
    rule_plan(cfg.model, world=2, devices_per_node=2, batch_size=32, sharding=ShardingType.table_wise,
              step_ms=10.0).save(plan)
    r = run_cli(_args(plan, root / "ckpt"), root)
    assert r.returncode == 0, r.stderr
    return {"plan": plan, "ckpt": root / "ckpt", "dir": root}


def _copy_ckpt(ref: dict[str, Path], dst: Path) -> Path:
    shutil.copytree(ref["ckpt"], dst)
    return dst


def _error_lines(stderr: str) -> list[str]:
    """stderr without tqdm's progress bar (rank 0 draws it on stderr) and blank lines."""
    return [line for line in stderr.splitlines()
            if line.strip() and not re.search(r"\d+%\||step/s|\d+/\d+ \[", line)]


def _one_line(r: subprocess.CompletedProcess, code: int, *expected: str) -> str:
    lines = _error_lines(r.stderr)
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------------------------- processes

def _descendants(pid: int) -> set[int]:
    """Every live process below pid (from /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent[int(d.name)] = int(fields[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.update(kids)
        todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Background:
    """`neocfg ...` in a session of its own (as a shell job: Ctrl-C reaches its whole process group)."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        full = {k: v for k, v in os.environ.items() if k != "NEOCFG_DEBUG"}
        full.update(env)
        self.out, self.err = open(cwd / "bg.out", "w+"), open(cwd / "bg.err", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "neocfg", *args], cwd=cwd, env=full,
                                     stdout=self.out, stderr=self.err, start_new_session=True)

    def ranks(self) -> set[int]:
        return _descendants(self.proc.pid)

    def finish(self, timeout: float = 60) -> subprocess.CompletedProcess:
        code = self.proc.wait(timeout)
        self.out.seek(0)
        self.err.seek(0)
        return subprocess.CompletedProcess(self.proc.args, code, self.out.read(), self.err.read())

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def _hung_run(ref: dict[str, Path], tmp_path: Path, flags: tuple[str, ...] = ()) -> tuple[Background, Path, set[int]]:
    """A run whose rank 1 hangs after step 7; returns once step 6's checkpoint is complete, with the rank pids."""
    ckpt = tmp_path / "ckpt"
    bg = Background([*flags, *_args(ref["plan"], ckpt)], tmp_path, HANG)
    latest = ckpt / "latest"
    _wait(lambda: latest.exists() and latest.read_text().strip() == "step_00000006", 120, "step 6's checkpoint")
    time.sleep(1.0)  # rank 1 reaches its hang, rank 0 blocks in the next collective
    ranks = bg.ranks()
    assert len(ranks) >= 2, ranks
    return bg, ckpt, ranks


def _signal_hung_run(ref: dict[str, Path], tmp_path: Path, send: Callable[[Background, Path], None],
                     flags: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, Path]:
    """Hang a run, `send` it something, and check that it ended with every rank gone and step 6 kept."""
    bg, ckpt, ranks = _hung_run(ref, tmp_path, flags)
    try:
        send(bg, ckpt)
        r = bg.finish()
        _wait(lambda: not any(_alive(p) for p in ranks), 15, "the ranks to exit")
    finally:
        for p in ranks:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        bg.kill()
    assert (ckpt / "latest").read_text().strip() == "step_00000006"
    return r, ckpt


def _resume_matches_reference(ref: dict[str, Path], ckpt: Path, cwd: Path) -> None:
    r = run_cli(_args(ref["plan"], ckpt, "train.resume=true"), cwd)
    assert r.returncode == 0, r.stderr[-2000:]
    last = f"step_{STEPS:08d}"
    for rank in range(2):
        assert_same_rank_state(torch.load(ref["ckpt"] / last / f"rank_{rank}.pt", weights_only=False),
                               torch.load(ckpt / last / f"rank_{rank}.pt", weights_only=False))


def test_ctrl_c_stops_every_rank_in_one_line_and_resume_is_bit_identical(ref, tmp_path):
    r, ckpt = _signal_hung_run(ref, tmp_path, lambda bg, _: os.killpg(bg.proc.pid, signal.SIGINT))  # Ctrl-C
    _one_line(r, 130, "neocfg: interrupted by SIGINT")
    _resume_matches_reference(ref, ckpt, tmp_path)


def test_sigterm_stops_the_run_and_the_checkpoint_lock_names_its_holder(ref, tmp_path):
    def lock_then_term(bg: Background, ckpt: Path) -> None:
        # a second run on the same checkpoint directory is refused while the first holds it
        other = tmp_path / "other"
        other.mkdir()
        r = run_cli(_args(ref["plan"], ckpt, "train.resume=true"), other)
        line = _one_line(r, 7, f"checkpoint directory {ckpt} is in use by another run", f"pid {bg.proc.pid} on host")
        assert "train.checkpoint_dir" in line
        assert not (other / "outputs").exists()  # nothing half-written by the refused run
        os.kill(bg.proc.pid, signal.SIGTERM)  # the launcher only: it must stop its ranks itself

    # as one job of a sweep (-m): an interrupted sweep ends the same way
    r, _ = _signal_hung_run(ref, tmp_path, lock_then_term, flags=("-m",))
    _one_line(r, 143, "neocfg: interrupted by SIGTERM")


def test_sigkilled_launcher_leaves_no_orphan_rank_and_no_lost_checkpoint(ref, tmp_path):
    # no handler runs on SIGKILL: the ranks must die with their parent (waited for in _signal_hung_run)
    _, ckpt = _signal_hung_run(ref, tmp_path, lambda bg, _: os.kill(bg.proc.pid, signal.SIGKILL))
    # the lock died with its holder and step 6 is intact: the resumed run finishes as the uninterrupted one did
    _resume_matches_reference(ref, ckpt, tmp_path)


# ---------------------------------------------------------------------------------------------- resume

def test_resume_falls_back_to_the_newest_valid_checkpoint_and_says_so(ref, tmp_path):
    ckpt = _copy_ckpt(ref, tmp_path / "ckpt")
    (ckpt / "latest").write_text("step_00000099\n")  # a pointer to a checkpoint that is gone
    r = run_cli(_args(ref["plan"], ckpt, "train.resume=true"), tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"checkpoint {ckpt}/step_00000099 is unusable (it does not exist); resuming from the newest valid" \
           f" checkpoint, {ckpt}/step_00000009" in r.stdout
    # ... which is finished: said as such, no throughput from zero steps
    assert "nothing to train: the run in" in r.stdout and "already finished" in r.stdout
    assert "samples/s" not in r.stdout and not list((tmp_path / "outputs").rglob("metrics.json"))


def test_truncated_rank_file_is_named_and_skipped(ref, tmp_path):
    ckpt = _copy_ckpt(ref, tmp_path / "ckpt")
    last = ckpt / "step_00000009" / "rank_0.pt"
    size = last.stat().st_size
    with open(last, "r+b") as f:
        f.truncate(size // 2)
    r = run_cli(_args(ref["plan"], ckpt, "train.resume=true", "train.steps=6"), tmp_path)
    assert r.returncode == 0, r.stderr
    assert (f"step_00000009 is unusable (rank_0.pt is truncated ({size // 2:,} of {size:,} bytes)); resuming from"
            f" the newest valid checkpoint, {ckpt}/step_00000006") in r.stdout

    # no valid checkpoint left: one line naming the file, exit 5, nothing started
    with open(ckpt / "step_00000006" / "rank_0.pt", "r+b") as f:
        f.truncate(100)
    r = run_cli(_args(ref["plan"], ckpt, "train.resume=true"), tmp_path)
    _one_line(r, 5, "rank_0.pt is truncated", "no older valid checkpoint", "train.resume=false")


def test_a_failing_rank_reports_its_exception(ref, tmp_path):
    """A checkpoint that is a complete file but holds the wrong content fails inside the rank: the one line
    carries the exception's type and message (not `rank 0 failed:` and a blank)."""
    ckpt = _copy_ckpt(ref, tmp_path / "ckpt")
    step = ckpt / "step_00000006"
    shutil.rmtree(ckpt / "step_00000009")
    (ckpt / "latest").write_text("step_00000006\n")
    torch.save({"step": 6}, step / "rank_0.pt")
    meta = json.loads((step / "meta.json").read_text())
    meta["rank_file_bytes"]["0"] = (step / "rank_0.pt").stat().st_size
    (step / "meta.json").write_text(json.dumps(meta))
    r = run_cli(_args(ref["plan"], ckpt, "train.resume=true"), tmp_path, timeout=300)
    _one_line(r, 6, "neocfg: error: rank 0 failed: KeyError: 'embeddings'")


def test_resume_with_another_model_gives_checked_advice(ref, tmp_path):
    ckpt = _copy_ckpt(ref, tmp_path / "ckpt")
    # another model: its plan.json would not fit this model, so it must not be suggested
    planned = [a for a in _args(ref["plan"], ckpt, "train.resume=true") if not a.startswith("planner.plan_file")]
    r = run_cli([*planned, "model.tables.0.num_embeddings=2000"], tmp_path)
    line = _one_line(r, 5, "was written for a different plan", "trained on another model",
                     "table t0 is 1,000x16 there, 2,000x16 here", "train.resume=false")
    assert "checked against this model" not in line
    # the same model planned differently: the checkpoint's own plan is suggested, and following it works
    r = run_cli(planned, tmp_path)
    line = _one_line(r, 5, "was written for a different plan", "checked against this model")
    suggested = re.search(r"(planner\.plan_file=\S+?),", line).group(1)
    r = run_cli([*_args(ref["plan"], ckpt, "train.resume=true"), suggested], tmp_path)
    assert r.returncode == 0 and "already finished" in r.stdout, r.stderr


# ---------------------------------------------------------------------------------------------- bad input

BAD = [
    (["train.dense_learning_rate=nan"], 2, ["train.dense_learning_rate=nan", "finite"]),
    (["hardware.device.hbm_gib=inf"], 2, ["hardware.device.hbm_gib=inf", "finite"]),
    (["dsi.headroom=-inf"], 2, ["dsi.headroom=-inf", "finite"]),
    (["planner.costs.hbm_efficiency=nan"], 2, ["planner.costs.hbm_efficiency=nan", "finite"]),
    (["model.tables.0.num_embeddings=100000000000000000000000"], 2,
     ["model.tables.0.num_embeddings=100000000000000000000000", "1,024 nodes", "no cluster could hold it"]),
    (["hardware.device.hbm_gib=1e300"], 2, ["hardware.device.hbm_gib=1e+300", "1 PiB"]),
    (["hardware.nodes=100000"], 2, ["hardware.nodes=100000", "<= 1,024"]),
    (["model.tables.99.num_embeddings=5"], 2, ["model.tables.99: no such entry", "8 (indices 0-7)"]),
    (["dsi=parquet_local", "+dsi.transforms=[{column:x,op:frobnicate}]"], 2,
     ["dsi.transforms.0.op='frobnicate'", "filter"]),
]


@pytest.mark.parametrize("overrides,code,expected", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_value_is_one_line_naming_the_key(cli, tmp_path, overrides, code, expected):
    r = cli("mode=describe", *overrides)
    _one_line(r, code, *expected)
    assert not (tmp_path / "outputs").exists()


PRESET_FAULTS = [  # (line to change in conf/dsi/parquet_local.yaml, replacement, expected in the message)
    ("seed: 1234", "sead: 1234", ["parquet_local.yaml:{line}: dsi.sead: unknown key"]),
    ("op: hash}", "op: frobnicate}", ["parquet_local.yaml:{line}: dsi.transforms.5.op='frobnicate' is invalid",
                                       "filter, fill_missing"]),
    ("workers: auto", "workers: [auto", ["parquet_local.yaml:{line}: YAML syntax error"]),
]


@pytest.mark.parametrize("old,new,expected", PRESET_FAULTS, ids=["misspelled_key", "bad_enum", "yaml_syntax"])
def test_preset_error_names_file_line_and_key(cli, tmp_path, old, new, expected):
    src = Path(__file__).resolve().parent.parent / "conf" / "dsi" / "parquet_local.yaml"
    lines = src.read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if old in line)
    lines[index] = lines[index].replace(old, new)
    user = tmp_path / "myconf" / "dsi"
    user.mkdir(parents=True)
    (user / "mine.yaml").write_text("\n".join(lines) + "\n")
    r = cli("--config-dir", str(tmp_path / "myconf"), "mode=describe", "dsi=mine")
    want = [e.replace("parquet_local.yaml", "mine.yaml").format(line=index + 1) for e in expected]
    if "YAML" in want[0]:  # the parser reports where it gave up: this line or the next
        want = [want[0].split(":", 1)[0]] + ["YAML syntax error"]
    _one_line(r, 2, *want)


@pytest.mark.parametrize("kind", ["file", "read_only"])
def test_unusable_checkpoint_dir_is_one_line_before_any_rank_starts(ref, cli, tmp_path, kind):
    if kind == "file":
        target = tmp_path / "afile"
        target.write_text("x")
        expected = ["is a file; must be a directory"]
    else:
        target = Path("/sys/fs")  # a directory on a read-only file system (even for root)
        expected = ["cannot be written"]
    r = cli(*_args(ref["plan"], target))
    _one_line(r, 2, f"train.checkpoint_dir='{target}' is invalid", *expected)
    assert not (tmp_path / "outputs").exists()


def test_one_step_run_prints_no_zero_breakdown(ref, cli, tmp_path):
    r = cli(*_args(ref["plan"], tmp_path / "ckpt", "train.steps=1", "train.checkpoint_every=0"))
    assert r.returncode == 0, r.stderr
    assert "step breakdown: not measured" in r.stdout
    assert "data_wait 0.00" not in r.stdout


# ---------------------------------------------------------------------------------------------- sweeps, advice

def _sweep_dir(tmp_path: Path) -> Path:
    dirs = [p.parent for p in (tmp_path / "multirun").rglob("multirun.yaml")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_sweep_where_every_run_fails_exits_non_zero(cli, tmp_path):
    r = cli("-m", "mode=describe", "hardware.nodes=0,-1")
    assert r.returncode == 8, r.stderr
    assert "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if "all 2 runs of the sweep failed" in line]
    md = (_sweep_dir(tmp_path) / "sweep_summary.md").read_text()
    rows = [line for line in md.splitlines()[2:] if line.startswith("| ")]
    assert len(rows) == 2 and all("must be > 0" in row for row in rows)
    assert "Traceback" not in md


def test_ilp_progress_line_while_a_sweep_plans(cli):
    r = cli("-m", "mode=plan", "train.batch_size=64,128", env={"NEOCFG_PROGRESS_EVERY_S": "0.05"})
    assert r.returncode == 0, r.stderr
    assert "planning dlrm_tiny on cpu_local: ilp still solving (stops by planner.time_limit_s=45)" in r.stderr


def test_advice_for_a_batch_too_large_is_verified(cli):
    r = cli("mode=plan", "train.batch_size=1000000000")
    line = _one_line(r, 3, "train.batch_size=1,000,000,000", "verified to fit: train.batch_size<=")
    assert "table t0" not in line
    batch = int(re.search(r"train\.batch_size<=([\d,]+)", line).group(1).replace(",", ""))
    r = cli("mode=plan", f"train.batch_size={batch}")
    assert r.returncode == 0, r.stderr  # the advice works with the planner that gave it


def test_advice_for_too_little_memory_is_verified(cli):
    small = ["model.tables.6.num_embeddings=40000000", "hardware.device.hbm_gib=0.5", "hardware.host.ddr_gib=1"]
    r = cli("mode=plan", *small)
    line = _one_line(r, 3, "does not fit", "verified to fit:")
    nodes = re.search(r"hardware\.nodes>=(\d+)", line)
    assert nodes, line
    r = cli("mode=plan", *small, f"hardware.nodes={nodes.group(1)}")
    assert r.returncode == 0, r.stderr  # the advised node count fits the planner that gave it


def test_advice_search_stops_at_its_budget_and_says_so():
    """A huge model makes every probe slow: past the budget the message says the search stopped (no guess)."""
    from neocfg.errors import InfeasibleError
    from neocfg.planner.advice import advise

    cfg = compose_cfg(["mode=plan", "model.tables.6.num_embeddings=40000000", "hardware.device.hbm_gib=0.5",
                       "hardware.host.ddr_gib=1"])
    msg = str(advise(cfg, InfeasibleError("table t6 does not fit; would fit with hardware.nodes>=2"), budget_s=0.0))
    assert msg == "table t6 does not fit; no change was verified to fit within 0 s of checking (fp16 weights, more" \
                  " nodes, a smaller batch: plan them to see)"
