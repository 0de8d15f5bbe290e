"""A laptop-sized copy of any model (model.shrink): the caps, planning and training it on cpu_local in one command,
the "does not fit" line that names the largest tables and points to it; every preset trains at the default learning
rates without diverging."""

from __future__ import annotations

import json
import re

import pytest

from conftest import CONF, compose_cfg
from neocfg.types import Interaction

MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
FAST = ["train.steps=24", "train.batch_size=64", "train.eval_batches=0", "train.log_every=4",
        "planner.algorithm=greedy"]


@pytest.mark.parametrize("model", ["prod_856", "dlrm_tiny", "criteo_tb_mlperf_v1"])
def test_shrink_caps_rows_dims_mlps_and_pooling(model):
    big = compose_cfg([f"model={model}"]).model
    small = compose_cfg([f"model={model}", "model.shrink=true", "model.shrink_to.max_rows=1e3",
                         "model.shrink_to.max_mlp_width=32"]).model
    assert len(small.tables) == len(big.tables) and not small.planning_only
    for b, s in zip(big.tables, small.tables):
        assert s.num_embeddings == min(b.num_embeddings, 1000)
        assert s.embedding_dim == min(b.embedding_dim, 16)
        assert s.pooling_factor == min(b.pooling_factor, 4.0)
    assert max(small.bottom_layers) <= 32 and max(small.top_mlp) <= 32 and small.top_mlp[-1] == 1
    assert small.interaction is big.interaction
    if small.interaction is Interaction.dot:
        assert small.bottom_layers[-1] == small.tables[0].embedding_dim


def test_does_not_fit_names_the_largest_tables_and_the_shrink_option(cli, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text(
        "name: mine\ntables:\n"
        "  - {name: small, num_embeddings: 1e4, embedding_dim: 16}\n"
        "  - {name: medium, num_embeddings: 1e8, embedding_dim: 64}\n"   # the first in file order that does not fit
        "  - {name: huge, num_embeddings: 2e9, embedding_dim: 128}\n"
        "  - {name: big, num_embeddings: 3e8, embedding_dim: 64}\n")
    r = cli("--config-dir", str(tmp_path), "mode=plan", "model=mine", "hardware=cpu_local", timeout=300)
    assert r.returncode == 3, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("neocfg: error: table huge (2,000,000,000 x 128) does not fit"), line
    assert "3 of its 4 tables do not fit, largest first (fp32): huge 953.7 GiB, big 71.5 GiB, medium 23.8 GiB" in line
    assert "model.shrink=true" in line, line
    # ... and mode=plan sizes the shrunk copy
    r = cli("mode=plan", "model=prod_856", "model.shrink=true", "hardware=cpu_local", "planner.algorithm=greedy",
            timeout=300)
    assert r.returncode == 0, r.stderr
    plan = json.loads(next((tmp_path / "outputs").rglob("plan.json")).read_text())
    assert len(plan["tables"]) == 856


@pytest.mark.parametrize("model,extra", [(m, ["model.shrink_to.max_rows=1000"]) for m in MODELS] + [
    ("dcnv2_mlperf", ["model.shrink_to.max_rows=1000", "model.shrink_to.max_dim=128",
                      "model.shrink_to.max_mlp_width=1024", "model.shrink_to.max_pooling=100"])],
    ids=[*MODELS, "dcnv2_mlperf_default_dims"])
def test_every_preset_trains_shrunk_at_default_learning_rates(cli, tmp_path, model, extra):
    """One command trains a shrunk copy of every preset (production ones included) on cpu_local at the default
    learning rates, and the loss does not run away (train.divergence_factor would stop it with exit code 9)."""
    r = cli("mode=train", f"model={model}", "model.shrink=true", *extra, *FAST, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(next((tmp_path / "outputs").rglob("metrics.json")).read_text())
    assert m["model"] == f"{model}_shrunk" and m["steps"] == 24
    assert max(m["losses"]) < 5 * m["initial_loss"], m["losses"]
