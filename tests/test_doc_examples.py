"""Every example output in README.md and docs/ is checked against a real run of its command: each line the docs
show must appear in the run's output with the same shape (its words and keys), whatever the numbers, paths and
timings. A `$ command` line of a fenced block starts an example; the lines after it, up to the next `$` line or
the end of the block, are its output."""

from __future__ import annotations

import re
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, run_cli

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?%?")
PATHS = re.compile(r"(/[\w.\-<>]+)+/?|outputs/[^\s:,]+|[^\s:,]+\.(json|parquet|png)\b")


@dataclass(frozen=True)
class Example:
    doc: str
    command: str
    output: tuple[str, ...]


def examples() -> list[Example]:
    out: list[Example] = []
    for doc in DOCS:
        in_block, cur = False, None
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                if cur:
                    out.append(cur)
                in_block, cur = not in_block, None
                continue
            if not in_block:
                continue
            if line.startswith("$ "):
                if cur:
                    out.append(cur)
                cur = Example(doc.name, line[2:].split("  #")[0].strip(), ())
            elif cur and line.strip():
                cur = Example(cur.doc, cur.command, cur.output + (line,))
    return out


def shape(line: str) -> str:
    """A line without its numbers, paths, model/table names in quotes and surrounding whitespace."""
    line = PATHS.sub("<path>", line)
    line = NUMBER.sub("#", line)
    line = re.sub(r"\s+", " ", line)
    return line.strip()


# How the tests run each documented command: cheaper settings (fewer steps and samples) that keep the output's
# shape, and the files it needs. A documented example missing here fails test_every_example_is_checked.
CHEAP = {
    "make run": ["train.steps=30", "train.log_every=10", "train.eval_batches=2"],
    "neocfg mode=describe model.tables.0.num_embeddings=-5": [],
    "neocfg mode=gen_data dsi=parquet_local": ["dsi.num_samples=20000", "dsi.eval_samples=2048"],
    "neocfg mode=train dsi=parquet_local train.steps=120": ["train.steps=20", "train.eval_batches=2"],
    "neocfg mode=plan train.batch_size=1000000000": [],
    "neocfg mode=plan": [],
    "neocfg mode=train planner.plan_file=bad_plan.json": [],
}
# Commands that need a service this test does not start (their own tests run them).
ELSEWHERE = {
    "neocfg mode=train dsi=parquet_local dsi.backend=ray train.steps=6 train.batch_size=64":
        "tests/test_data_ray.py runs mode=train on the Ray backend",
}


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[:2] == ["make", "run"]:
        return []
    assert words[0] == "neocfg", command
    return words[1:]


def test_every_example_is_checked():
    unchecked = [f"{e.doc}: $ {e.command}" for e in examples() if e.command not in CHEAP and e.command not in ELSEWHERE]
    assert not unchecked, f"documented examples without a check (add them to CHEAP or ELSEWHERE): {unchecked}"


def _prepare(command: str, cwd: Path) -> None:
    if "dsi=parquet_local" in command and "mode=gen_data" not in command:
        gen = run_cli(["mode=gen_data", "dsi=parquet_local", "dsi.num_samples=8192", "dsi.eval_samples=2048"], cwd)
        assert gen.returncode == 0, gen.stderr
    if "bad_plan.json" in command:
        # A row-wise plan of the default model whose table t1 has its first shard's rows grown by 10 and the second's
        # start moved back by 10: rows covered twice.
        plan = run_cli(["mode=plan", "planner.sharding_types=[row_wise]", "hydra.run.dir=plan_run"], cwd)
        assert plan.returncode == 0, plan.stderr
        data = json.loads((cwd / "plan_run" / "plan.json").read_text())
        first, second = next(t for t in data["tables"] if t["name"] == "t1")["shards"][:2]
        first["num_rows"] += 10
        second["row_offset"] -= 10
        (cwd / "bad_plan.json").write_text(json.dumps(data))


@pytest.mark.parametrize("example", [e for e in examples() if e.command in CHEAP],
                         ids=lambda e: f"{e.doc}:{e.command[:60]}")
def test_example_output_has_the_documented_shape(example, tmp_path):
    _prepare(example.command, tmp_path)
    res = run_cli(_argv(example.command) + CHEAP[example.command], tmp_path, timeout=900)
    got = {shape(line) for line in (res.stdout + res.stderr).splitlines()}
    missing = [line for line in example.output if shape(line) not in got]
    assert not missing, (f"{example.doc}: `$ {example.command}` no longer prints these lines (shape compared, "
                         f"numbers ignored): {missing}\nit printed:\n{res.stdout}\n{res.stderr}")


def test_shape_ignores_numbers_and_paths_but_not_words():
    assert shape("trained dlrm_tiny on 2 ranks: 3000 steps, 1,536,000 samples") == \
        shape("trained dlrm_tiny on 4 ranks: 30 steps, 15,360 samples")
    assert shape("outputs in outputs/2026-12-03/16-25-13: metrics.json") == shape("outputs in outputs/x/y: metrics.json")
    assert shape("loss 0.69 -> 0.47") != shape("loss 0.69 => 0.47")


def test_a_changed_line_is_caught(tmp_path):
    """The check is not vacuous: a documented line the run does not print is reported."""
    example = Example("README.md", "neocfg mode=describe model.tables.0.num_embeddings=-5",
                      ("neocfg: error: model.tables.0.num_embeddings=-5 is invalid: must be < 0",))
    res = run_cli(_argv(example.command), tmp_path)
    got = {shape(line) for line in (res.stdout + res.stderr).splitlines()}
    assert shape(example.output[0]) not in got
