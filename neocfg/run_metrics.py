"""What a training run measured: one typed record, serialized as metrics.json (a contract beside plan.json; keys
are kept). The runtime fills it, `mode=train` prints it (render) and writes it, the sweep summary reads it back."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from neocfg.fileio import read_json, write_text_atomic

METRICS_FILE = "metrics.json"
# The step breakdown's laps (neocfg.runtime.timing.StepTimes) in the order the summary prints them; the replicas'
# laps (dp_update, comm_dp) only where a run has data-parallel tables.
BREAKDOWN_ORDER = ("data_wait", "comm_input", "emb_fwd", "comm_fwd", "dense", "dp_update", "comm_dp", "comm_bwd",
                   "emb_bwd", "prefetch", "total")
REPLICA_LAPS = ("dp_update", "comm_dp")


@dataclass(frozen=True)
class TermMs:
    """One term of the step time: the plan's prediction next to the measurement it models (ms per step).
    Serialized as the pair [predicted, measured]."""

    predicted: float
    measured: float

    @property
    def ratio(self) -> float:
        """predicted / measured (inf when nothing was measured)."""
        return self.predicted / self.measured if self.measured > 0 else float("inf")


@dataclass(frozen=True)
class DppCounters:
    backend: Optional[str] = None
    workers: int = 0
    worker_restarts: int = 0
    bytes_read: int = 0


@dataclass(frozen=True)
class RunMetrics:
    model: str
    world_size: int
    batch_size_per_rank: int
    global_batch: int
    steps: int                              # the run's step count at the end (resumed runs included)
    steps_this_run: int
    resumed_from_step: Optional[int]
    samples: int
    samples_per_s: float
    wall_s: float
    checkpoint_s: float
    initial_loss: Optional[float]
    final_loss: Optional[float]
    final_loss_mean_last_10: Optional[float]
    losses: list[float]                     # global mean loss per step, step 1 first
    # the highest loss and its step (1-based); the summary shows it where it is above the first
    max_loss: Optional[float]
    max_loss_step: Optional[int]
    # held-out evaluation (0 samples and None when train.eval_batches=0)
    eval_samples: int
    eval_logloss: Optional[float]
    eval_ne: Optional[float]
    eval_auc: Optional[float]
    eval_ctr: Optional[float]
    # mean ms per timed step of each lap (StepTimes), over ranks, and per rank
    breakdown_ms: dict[str, float]
    breakdown_ms_per_rank: list[dict[str, float]]
    timed_steps: int
    warmup_steps: int
    predicted_step_ms: float
    measured_step_ms: float
    plan_batch_size_per_device: int
    # The planner's terms next to the measured ones they model (neocfg.planner.estimate's terms).
    predicted_vs_measured_ms: dict[str, TermMs]
    prediction_error: Optional[float]       # (measured - predicted) / predicted
    a2a_fwd_dtype: str
    a2a_bwd_dtype: str
    sparse_optimizer: str
    dense_optimizer: str
    plan_solver: str
    # the data sources' counters: over ranks (fractions averaged, counts and seconds summed), and per rank
    data: dict[str, Any]
    data_per_rank: list[dict[str, Any]]
    data_stall_fraction: float
    samples_delivered: int
    duplicate_samples: int
    dpp: DppCounters = field(default_factory=DppCounters)

    @property
    def batch_differs_from_plan(self) -> bool:
        return self.plan_batch_size_per_device != self.batch_size_per_rank

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["predicted_vs_measured_ms"] = {k: [t.predicted, t.measured] for k, t in self.predicted_vs_measured_ms.items()}
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "RunMetrics":
        known = {f.name for f in dataclasses.fields(RunMetrics)}
        values = {k: v for k, v in d.items() if k in known}
        values["predicted_vs_measured_ms"] = {k: TermMs(*pair) for k, pair in d["predicted_vs_measured_ms"].items()}
        values["dpp"] = DppCounters(**(d.get("dpp") or {}))
        return RunMetrics(**values)

    def save(self, path: Path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: Path) -> "RunMetrics":
        return read_json(path, RunMetrics.from_dict, "metrics file not found", "not a valid neocfg metrics.json")


def render(m: RunMetrics) -> str:
    """The summary `mode=train` prints."""
    resumed = (f" (resumed from step {m.resumed_from_step:,}: {m.steps_this_run:,} steps in this run)"
               if m.resumed_from_step is not None else "")
    lines = [f"trained {m.model} on {m.world_size} ranks: {m.steps} steps{resumed}, {m.samples:,} samples, "
             f"{m.samples_per_s:,.0f} samples/s"]
    if m.final_loss is not None:
        highest = (f"highest {m.max_loss:.4g} at step {m.max_loss_step}; "
                   if m.max_loss is not None and m.max_loss > m.initial_loss else "")
        lines.append(f"  loss {m.initial_loss:.4g} (step 1) -> {m.final_loss:.4g} (step {m.steps}); {highest}"
                     f"mean of the last 10 steps {m.final_loss_mean_last_10:.4g}")
    if m.eval_auc is not None:
        lines.append(f"  held-out ({m.eval_samples:,} samples): AUC {m.eval_auc:.4f}, NE {m.eval_ne:.4f}, "
                     f"log loss {m.eval_logloss:.4f}")
    b = m.breakdown_ms
    if m.timed_steps:
        lines.append("  step breakdown (ms, mean over ranks): " + ", ".join(
            f"{k} {b[k]:.2f}" for k in BREAKDOWN_ORDER if k in b and (b[k] or k not in REPLICA_LAPS)))
    else:
        lines.append(f"  step breakdown: not measured (the first {m.warmup_steps} steps of a run are warm-up;"
                     f" train more steps to see it); the step time below includes the warm-up")
    if m.prediction_error is not None:
        lines.append(f"  step time: predicted {m.predicted_step_ms:.2f} ms, measured {m.measured_step_ms:.2f} ms "
                     f"(prediction error {100 * m.prediction_error:+.0f}%)")
        if m.batch_differs_from_plan:
            lines.append(f"  (the plan was made for batch {m.plan_batch_size_per_device} per device, this run used "
                         f"{m.batch_size_per_rank})")
        lines.append("  predicted / measured ms: " + ", ".join(
            f"{k} {t.predicted:.2f} / {t.measured:.2f}" for k, t in m.predicted_vs_measured_ms.items()))
    else:
        lines.append(f"  step time: measured {m.measured_step_ms:.2f} ms (the plan has no estimate)")
    if m.timed_steps:  # a run too short to time its steps has no stall or deviation to report
        lines.append(f"  data stall: {100 * m.data_stall_fraction:.1f}% of the step waiting for batches"
                     f" (data_wait {b.get('data_wait', 0.0):.2f} ms)")
        warning = deviation_warning(m)
        if warning:
            lines.append(warning)
    return "\n".join(lines)


# A measured step this far off the estimate (either way) gets a warning naming the term that deviates most.
DEVIATION_WARN = 0.5


def deviation_warning(m: RunMetrics) -> Optional[str]:
    """'neocfg: warning: ...' when the measured step is more than DEVIATION_WARN off the estimate: the estimate's
    term whose measurement is furthest from it (in ms), with both values; None otherwise."""
    err, terms = m.prediction_error, m.predicted_vs_measured_ms
    if err is None or abs(err) <= DEVIATION_WARN or not terms:
        return None
    name, t = max(terms.items(), key=lambda kv: abs(kv[1].measured - kv[1].predicted))
    return (f"neocfg: warning: the measured step ({m.measured_step_ms:.2f} ms) is {100 * err:+.0f}% off the"
            f" estimate ({m.predicted_step_ms:.2f} ms); the term furthest off: {name}, predicted {t.predicted:.2f} ms,"
            f" measured {t.measured:.2f} ms ({t.measured - t.predicted:+.2f} ms)")
