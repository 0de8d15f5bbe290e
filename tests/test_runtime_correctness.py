"""The core: K steps of every sharding type on 2 (and 4) gloo ranks train the same model as one process
with the unsharded tables, the same initialization and data, and the same fused fbgemm optimizer.

Tolerances (fp32): per-step losses within LOSS_ATOL; embedding and dense weights within WEIGHT_ATOL (Adagrad
family) or SGD_WEIGHT_ATOL (SGD), and every table's error within UPDATE_RTOL of how far training moved it from its
initial values (every table must have moved); optimizer state within OPT_RTOL of its largest value; data-parallel
replicas bit-identical on every rank. The only differences are float summation orders (partial sums of RW/TWRW
shards, DDP's averaging, the 1/world gradient scale, the replicas' gradient all-reduce), ~1e-7 relative; Adagrad's step lr * g / sqrt(sum g^2) turns a tiny
relative error of a tiny gradient into up to ~lr x that error of the weight (measured worst case: 1.6e-4 for
element-wise Adagrad under CW, 6e-7 for row-wise Adagrad; SGD: 2e-10; losses: 1.2e-7).

Exact row-wise Adagrad keeps one accumulator per row *per column slice* under CW/TWCW (as in TorchRec), which is a
different optimizer from the unsharded one; CW/TWCW are therefore compared under exact Adagrad and exact SGD.

fp16/bf16 communication and fp16 weights (stochastic rounding) are compared under exact SGD (dense part too),
whose update is linear in the gradient, so rounding errors stay of their own size: losses within FP16_LOSS_ATOL,
weights within FP16_WEIGHT_ATOL and within FP16_UPDATE_RTOL of the movement.

Why these can fail (checked by doubling the embedding gradient in EmbeddingExchange.backward and in the replicas'
all-reduce): Adagrad's step lr * g / sqrt(sum g^2) hardly changes when g doubles,
so the weights cannot show such an error; its optimizer state (sum of g^2, x4) can, and is compared relative to its
own size (row-wise Adagrad states are ~1e-6: an absolute tolerance of 1e-3 let anything pass). SGD cases run the
embeddings at SGD_SPARSE_LR: at the default 0.05 five steps move the tables by 5e-6..6e-5, less than one fp16
rounding of the weights (2e-5 measured), so fp16 weights could not tell a right update from a doubled one; at
SGD_SPARSE_LR the movement is ~100x larger than the rounding.
"""

from __future__ import annotations

import pytest
import torch

from conftest import compose_cfg
from runtime_helpers import RunState, run_reference, run_sharded, with_train
from neocfg.runtime.init_weights import init_rows
from neocfg.runtime.plans import rule_plan
from neocfg.types import CommDtype, DenseOptimizer, ShardingType as S, SparseOptimizer, WeightsDtype

STEPS = 5
BATCH = 32
LOSS_ATOL = 1e-5
WEIGHT_ATOL = 1e-3
SGD_WEIGHT_ATOL = 1e-6
FP16_LOSS_ATOL = 1e-3
FP16_WEIGHT_ATOL = 1e-3
# Error / movement from the initial values, per table: fp32 measured <= 1.1e-4 (Adagrad under CW); fp16 weights and
# bf16 communication at SGD_SPARSE_LR: rounding of 2^-11 / 2^-8 relative.
UPDATE_RTOL = 1e-2
FP16_UPDATE_RTOL = 0.2
# Optimizer state error / the state's largest value: measured <= 1.7e-5 (TWRW 2x2; summation order only).
OPT_RTOL = 1e-4
SGD_SPARSE_LR = 5.0

BASE = ["train.batch_size=32", f"train.steps={STEPS}", "train.eval_batches=1", "train.log_every=100",
        # a 3-row table: row-wise over 4 ranks leaves one rank an empty row range
        "model.tables.7.num_embeddings=3"]


def _cfg(opt: SparseOptimizer = SparseOptimizer.exact_rowwise_adagrad, overrides: tuple[str, ...] = ()):
    # SGD runs use SGD for the dense part too (the fp16 comparisons need an update linear in the gradient).
    sgd = opt is SparseOptimizer.exact_sgd
    dense = DenseOptimizer.sgd if sgd else DenseOptimizer.adagrad
    cfg = compose_cfg(BASE + list(overrides))
    lr = SGD_SPARSE_LR if sgd else cfg.train.sparse_learning_rate
    return with_train(cfg, sparse_optimizer=opt, dense_optimizer=dense, sparse_learning_rate=lr)


ROWWISE, ADAGRAD, SGD = (SparseOptimizer.exact_rowwise_adagrad, SparseOptimizer.exact_adagrad,
                         SparseOptimizer.exact_sgd)
MIXED_2 = [S.table_wise, S.row_wise, S.data_parallel, S.column_wise, S.row_wise, S.table_wise, S.table_row_wise,
           S.data_parallel]
MIXED_4 = [S.table_row_wise, S.row_wise, S.data_parallel, S.table_column_wise, S.table_wise, S.column_wise,
           S.table_row_wise, S.row_wise]

DCN = ("model.interaction=dcn", "model.dcn_num_layers=2", "model.dcn_low_rank_dim=8")

# name -> (world, sparse optimizer, sharding (one type or per-table list), extra plan fields[, config overrides])
CASES = {
    "tw": (2, ROWWISE, S.table_wise, {}),
    # every table on rank 0: rank 1 holds nothing and still takes part in every collective
    "tw_one_rank_empty": (2, ROWWISE, S.table_wise, {"ranks": {f"t{i}": [0] for i in range(8)}}),
    "cw_adagrad": (2, ADAGRAD, S.column_wise, {}),
    "cw_sgd": (2, SGD, S.column_wise, {}),
    "rw": (2, ROWWISE, S.row_wise, {}),
    "twrw_1node": (2, ROWWISE, S.table_row_wise, {}),
    "dp": (2, ROWWISE, S.data_parallel, {}),
    "mixed": (2, ADAGRAD, MIXED_2, {}),
    "fp16_comm": (2, SGD, MIXED_2, {"a2a_fwd_dtype": CommDtype.fp16, "a2a_bwd_dtype": CommDtype.fp16}),
    "bf16_comm": (2, SGD, MIXED_2, {"a2a_fwd_dtype": CommDtype.bf16, "a2a_bwd_dtype": CommDtype.bf16}),
    "fp16_weights": (2, SGD, MIXED_2, {"weights_dtype": WeightsDtype.fp16}),
    "mixed_dcn": (2, ROWWISE, [S.table_wise, S.row_wise, S.data_parallel, S.table_wise] * 2, {}, DCN),
    "twrw_2x2": (4, ROWWISE, S.table_row_wise, {}),
    "twcw_2x2": (4, ADAGRAD, S.table_column_wise, {}),
    "rw_4": (4, ROWWISE, S.row_wise, {}),
    "mixed_4": (4, ADAGRAD, MIXED_4, {}),
    # every case above runs with the defaults: train.ids_exchange=auto (ids exchanged in the prefetch thread when
    # a table is row-sharded, else in the pipelined step, train.pipeline=true); these run the plain step with the
    # ids exchanged in it, and the pipelined step with the next batch's ids sent in it (what GPU ranks do)
    "mixed_unpipelined": (2, ADAGRAD, MIXED_2, {}, ("train.pipeline=false", "train.ids_exchange=step")),
    "mixed_4_unpipelined": (4, ADAGRAD, MIXED_4, {}, ("train.pipeline=false", "train.ids_exchange=step")),
    "mixed_in_step": (2, ADAGRAD, MIXED_2, {}, ("train.ids_exchange=step",)),
    # DDP on the dense part: the pooled outputs' all-to-all overlaps the bottom MLP, both ways (SGD: a wrong factor
    # on the embeddings' gradient shows, where Adagrad's first steps hide it)
    "mixed_ddp": (2, SGD, MIXED_2, {}, ("train.dense_grad_sync=ddp",)),
    # the row-wise partial sums by reduce-scatter (GPUs' default; CPU ranks send them by all-to-all)
    "rw_reduce_scatter": (2, ROWWISE, S.row_wise, {}, ("train.partial_sums=reduce_scatter",)),
    "mixed_4_reduce_scatter": (4, ADAGRAD, MIXED_4, {}, ("train.partial_sums=reduce_scatter",)),
}
FP16_CASES = {"fp16_comm", "bf16_comm", "fp16_weights"}


def _plan(world, opt, sharding, extra, overrides=()):
    cfg = _cfg(opt, overrides)
    if isinstance(sharding, list):
        sharding = {t.name: s for t, s in zip(cfg.model.tables, sharding)}
    return cfg, rule_plan(cfg.model, world=world, devices_per_node=2, batch_size=BATCH, sharding=sharding, **extra)


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[RunState, RunState]]:
    out: dict[str, tuple[RunState, RunState]] = {}
    refs: dict[tuple, RunState] = {}
    for world in (2, 4):
        names = [n for n, c in CASES.items() if c[0] == world]
        jobs = [_plan(*CASES[n]) for n in names]
        for n, state in zip(names, run_sharded(jobs, world)):
            opt, overrides = CASES[n][1], tuple(CASES[n][4]) if len(CASES[n]) > 4 else ()
            if (world, opt, overrides) not in refs:
                refs[(world, opt, overrides)] = run_reference(_cfg(opt, overrides), world)
            out[n] = (state, refs[(world, opt, overrides)])
    return out


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _initial_tables(cfg) -> list[torch.Tensor]:
    return [init_rows(cfg.train.seed, i, t.num_embeddings, t.embedding_dim, 0, t.num_embeddings)
            for i, t in enumerate(cfg.model.tables)]


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_equals_unsharded(results, name):
    got, ref = results[name]
    fp16 = name in FP16_CASES
    if fp16:
        loss_tol, w_tol = FP16_LOSS_ATOL, FP16_WEIGHT_ATOL
    else:
        loss_tol, w_tol = LOSS_ATOL, SGD_WEIGHT_ATOL if CASES[name][1] is SGD else WEIGHT_ATOL
    assert len(got.losses) == len(ref.losses) == STEPS
    assert max(abs(a - b) for a, b in zip(got.losses, ref.losses)) <= loss_tol, (got.losses, ref.losses)
    assert all(not torch.isnan(t).any() for t in got.tables), "a shard is missing from the assembled tables"
    assert _max_diff(got.tables, ref.tables) <= w_tol
    assert _max_diff([got.dense[k] for k in ref.dense], list(ref.dense.values())) <= w_tol
    # every table moved away from its initial values, by much more than the sharded run's error
    init = _initial_tables(_cfg(CASES[name][1], tuple(CASES[name][4]) if len(CASES[name]) > 4 else ()))
    for t, (g, r, w0) in enumerate(zip(got.tables, ref.tables, init)):
        moved = float((r - w0).abs().max())
        assert moved > 0 and float((g - w0).abs().max()) > 0, f"table {t} never trained"
        err = float((g - r).abs().max())
        assert err <= (FP16_UPDATE_RTOL if fp16 else UPDATE_RTOL) * moved, (t, err, moved)
    for t, (g, r) in enumerate(zip(got.optimizer, ref.optimizer)):
        if r is not None:
            assert float((g - r).abs().max()) <= OPT_RTOL * float(r.abs().max()), f"table {t} optimizer state"
    # data-parallel replicas stay bit-identical (weights and optimizer state) on every rank
    assert got.replicas_identical
    dp_tables = sum(1 for s in (CASES[name][2] if isinstance(CASES[name][2], list) else [CASES[name][2]] * 8)
                    if s is S.data_parallel)
    assert got.replicas == dp_tables * (CASES[name][0] - 1)


def test_metrics_of_a_sharded_run(results):
    got, _ = results["mixed"]
    m = got.metrics
    assert m.steps == STEPS and m.samples == STEPS * BATCH * 2
    assert m.samples_per_s > 0 and m.eval_auc is not None
    for k in ("data_wait", "emb_fwd", "emb_bwd", "comm_input", "comm_fwd", "comm_bwd", "dense", "total"):
        assert m.breakdown_ms[k] >= 0
    assert len(m.breakdown_ms_per_rank) == 2
    # every batch's ids were exchanged in the prefetch thread (ids_exchange=auto with row-sharded tables), on both
    # ranks; none with ids_exchange=step, nor under auto without a row-sharded table
    assert m.data["batches_prepared"] >= 2 * STEPS
    assert results["mixed_in_step"][0].metrics.data["batches_prepared"] == 0
    assert results["tw"][0].metrics.data["batches_prepared"] == 0


@pytest.mark.parametrize("name,other", [("mixed", "mixed_unpipelined"), ("mixed_4", "mixed_4_unpipelined"),
                                        ("mixed_in_step", "mixed_unpipelined")])
def test_pipelined_step_equals_the_plain_one(results, name, other):
    """The pipelined step only moves the next batch's ids earlier (in the step, or in the prefetch thread): the same
    losses and weights as the plain step, bit for bit."""
    piped, plain = results[name][0], results[other][0]
    assert piped.losses == plain.losses
    assert all(torch.equal(a, b) for a, b in zip(piped.tables, plain.tables))
    assert all(torch.equal(piped.dense[k], plain.dense[k]) for k in plain.dense)
