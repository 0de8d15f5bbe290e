"""Schema of the `train` section: batch, steps, optimizers, evaluation and checkpointing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from neocfg.config import checks
from neocfg.errors import ConfigError
from neocfg.types import (DenseGradSync, DenseOptimizer, DensePrecision, IdsExchange, OutputOverlap, PartialSums,
                          PrefetchPriority, SparseOptimizer)


@dataclass
class TrainConfig:
    # Samples per device per step (the global batch is batch_size x world size).
    batch_size: int = 256
    steps: int = 200
    eval_batches: int = 20
    dense_optimizer: DenseOptimizer = DenseOptimizer.adagrad
    dense_learning_rate: float = 0.05
    sparse_optimizer: SparseOptimizer = SparseOptimizer.exact_rowwise_adagrad
    sparse_learning_rate: float = 0.05
    seed: int = 0
    # Dense math: fp32, tf32 (TF32 matmuls on CUDA; fp32 on a CPU) or bf16 (autocast). The planner rates the dense
    # part at hardware.device's peak for this precision.
    dense_precision: DensePrecision = DensePrecision.tf32
    # Pipelined step (TorchRec's TrainPipelineSparseDist): the next batch's ids are sent to their owners while the
    # current batch computes; the same losses and weights as without it.
    pipeline: bool = True
    # CPU ranks: where each batch's ids are exchanged (IdsExchange): in the step, or in the data source's prefetch
    # thread while the steps before it run (the step then neither routes nor waits for ids, so `pipeline` has
    # nothing left to do); auto: prefetch when some table is row-sharded. The same losses and weights either way.
    ids_exchange: IdsExchange = IdsExchange.auto
    # The data source's prefetch thread at idle priority (it runs in the rank's waits rather than beside its
    # compute: faster whole runs on CPU ranks, not yet priced by the estimate), normal, or auto (normal for now; see
    # neocfg.types.PrefetchPriority).
    prefetch_priority: PrefetchPriority = PrefetchPriority.auto
    # How row-wise tables' partial sums reach their samples' ranks (PartialSums): reduce_scatter, all_to_all (the
    # same bytes, summed on arrival), or auto (all_to_all on CPU devices, whose gloo reduce-scatter is slow). The
    # same sums either way, up to the order of addition.
    partial_sums: PartialSums = PartialSums.auto
    # How the dense gradients are averaged over ranks: ddp (DDP's all-reduce), exchange (they ride in the
    # embeddings' backward all-to-all: one collective fewer per step), auto (exchange while world x dense bytes is
    # small, see neocfg.types.DenseGradSync).
    dense_grad_sync: DenseGradSync = DenseGradSync.auto
    # Whether the pooled outputs' all-to-all travels while the bottom MLP runs (and its gradients' while the bottom
    # MLP's backward runs): overlap, wait, or auto (overlap where the dense gradients are synced by DDP and some
    # output comes back by all-to-all; see neocfg.types.OutputOverlap). The same losses and weights either way.
    output_overlap: OutputOverlap = OutputOverlap.auto
    # Exact per-category step times: synchronize the device at every stopwatch mark (removes overlap; GPU only).
    profile: bool = False
    log_every: int = 10
    # Stop the run (DivergedError, exit code 9) when the global mean loss of a step is NaN/inf or more than this many
    # times the run's first loss (checked every log_every steps and before each checkpoint; 0: never). A run that
    # learns stays near or below its first loss (log loss 0.69 for balanced clicks); a learning rate that is too
    # high sends it past 1e2-1e26 within a few steps.
    divergence_factor: float = 10.0
    # Save a checkpoint every N steps (0: never) into checkpoint_dir (default: <run dir>/checkpoints).
    checkpoint_every: int = 0
    checkpoint_dir: Optional[str] = None
    resume: bool = False
    # A collective that waits longer than this fails the job instead of hanging (a dead or stuck rank).
    collective_timeout_s: float = 300.0

    def check(self, key: str = "train") -> None:
        checks.positive(f"{key}.batch_size", self.batch_size)
        checks.positive(f"{key}.steps", self.steps)
        checks.non_negative(f"{key}.eval_batches", self.eval_batches)
        checks.positive(f"{key}.dense_learning_rate", self.dense_learning_rate)
        checks.positive(f"{key}.sparse_learning_rate", self.sparse_learning_rate)
        checks.positive(f"{key}.log_every", self.log_every)
        if self.divergence_factor != 0 and not self.divergence_factor > 1:
            raise ConfigError(f"{key}.divergence_factor", self.divergence_factor,
                              "must be > 1 (a multiple of the first loss), or 0 to never stop a diverging run")
        checks.non_negative(f"{key}.checkpoint_every", self.checkpoint_every)
        checks.positive(f"{key}.collective_timeout_s", self.collective_timeout_s)
