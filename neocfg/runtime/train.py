"""One rank's training: build the sharded embeddings and the data-parallel dense part, run the steps, evaluate,
checkpoint.

Objective: the mean BCE over the global batch (world x batch_size samples). DDP (or, for a small dense part, the
embeddings' backward all-to-all: train.dense_grad_sync) averages the dense gradients over ranks; EmbeddingExchange
scales the embedding gradients by 1/world; so a sharded run follows the same trajectory
as one process training the unsharded model on the global batch.
"""

from __future__ import annotations

import datetime
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from neocfg.batch import Batch
from neocfg.config.schema import NeocfgConfig
from neocfg.data.dpp.sizing import PlannedDpp
from neocfg.data.source import BatchSource, make_source
from neocfg.errors import ConfigError, DivergedError
from neocfg.plan import Plan
from neocfg.plan_check import PlanError, strategies_fault
from neocfg.run_metrics import DppCounters, RunMetrics, TermMs
from neocfg.runtime.checkpoint import Checkpointer, rng_state, set_rng_state
from neocfg.runtime.dist import Comm, PendingPooled, Purpose, purpose_group
from neocfg.runtime.dlrm import (DDP_OPTIONS, DenseGrads, build_dense, dense_autocast, make_dense_optimizer,
                                 set_matmul_precision)
from neocfg.runtime.embedding import ShardedEmbeddings
from neocfg.runtime.layout import OutputKind, build_layout
from neocfg.runtime.routing import ID_DTYPES, LocalLookups, PendingIds, Routed
from neocfg.runtime.metrics import evaluate
from neocfg.runtime.timing import StepTimes, Stopwatch
from neocfg.types import DenseGradSync, IdsExchange

# Steps left out of the timing averages (first-touch allocation, thread pools warming up).
WARMUP_STEPS = 2
# Fault injection for the tests: "<rank>:<step>" makes that rank SIGKILL itself after that step's update,
# "<rank>:<step>:save" while writing that step's checkpoint (after its own file, before the checkpoint is complete),
# "<rank>:<step>:hang" stop responding (sleep) after that step.
FAULT_ENV = "NEOCFG_FAULT_KILL"


@dataclass
class RankResult:
    """What one rank reports back; rank 0's carries the merged metrics."""

    rank: int
    losses: list[float] = field(default_factory=list)     # global mean loss per step (every step of the run)
    metrics: Optional[RunMetrics] = None


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Host batch -> device, asynchronously: non_blocking copies from pinned memory (the synthetic source pins in
    its prefetch thread; anything else is pinned here)."""
    if device.type == "cpu":
        return batch
    parts = (batch.dense, batch.lengths, batch.values, batch.labels, batch.sample_ids,
             *(() if batch.weights is None else (batch.weights,)))
    return Batch(*(x.to(device, non_blocking=True) for x in (p if p.is_pinned() else p.pin_memory() for p in parts)))


def _fault_step(rank: int, kind: str = "kill") -> Optional[int]:
    spec = os.environ.get(FAULT_ENV, "").split(":")
    if len(spec) < 2 or int(spec[0]) != rank or (spec[2] if len(spec) > 2 else "kill") != kind:
        return None
    return int(spec[1])


class Trainer:
    def __init__(self, cfg: NeocfgConfig, plan: Plan, run_dir: Optional[Path], device: torch.device,
                 source: Optional[BatchSource] = None) -> None:
        """source: where the training batches come from (default: make_source(cfg), e.g. a benchmark's own)."""
        self.cfg, self.plan, self.run_dir, self.device = cfg, plan, run_dir, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if plan.world_size != self.world:
            raise ConfigError("planner.plan_file", plan.world_size,
                              f"the plan is for world size {plan.world_size}, this job has {self.world} ranks")
        # before any collective (a process group is one): every rank refuses, none waits on a peer that left
        if plan.strategies is None:
            raise ConfigError("planner.plan_file", None, "the plan has no strategies section (how its step runs); "
                              "plan it again with mode=plan, or resolve it with neocfg.planner.strategies."
                              "with_strategies")
        fault = strategies_fault(plan)   # the plan validator's rule (a plan file got it when it was loaded)
        if fault:
            raise PlanError(f"plan: strategies: {fault}")
        # Embedding collectives get a group of their own (DDP's bucketed all-reduces run asynchronously on the
        # default group; sharing it could interleave them differently on different ranks).
        timeout = datetime.timedelta(seconds=cfg.train.collective_timeout_s)
        group = purpose_group(Purpose.exchange, timeout)
        self.comm = Comm(group=group, rank=self.rank, world=self.world, timeout=timeout)
        self.sw = Stopwatch(device, profile=cfg.train.profile)
        tc = cfg.train
        self.strategies = st = plan.strategies
        self.layout = build_layout(plan, cfg.model, self.rank)
        # data-parallel replicas all-reduce their gradient on a group of their own too
        dp_group = (purpose_group(Purpose.replicas, timeout) if self.layout.tables_of(OutputKind.replicated)
                    else None)
        # ... and so do the ids, which the pipelined step sends while the exchange and DDP use theirs, and the ids
        # the prefetch thread exchanges ahead of the step (train.ids_exchange, CPU ranks; see below)
        id_group = purpose_group(Purpose.ids, timeout)
        ahead = st.ids_exchange is IdsExchange.prefetch
        ahead_group = purpose_group(Purpose.ids_ahead, timeout) if ahead else None
        self.emb = ShardedEmbeddings(self.layout, self.comm, tc, tc.batch_size, plan.a2a_fwd_dtype,
                                     plan.a2a_bwd_dtype, device, self.sw, seed=tc.seed, dp_group=dp_group,
                                     id_group=id_group, ahead_group=ahead_group, encoding=st.routing_encoding,
                                     id_dtype=ID_DTYPES[st.id_dtype], sums_by_all_to_all=st.sums_by_all_to_all)
        # The pipelined step's look-ahead (_pipelined_batch): this step's batch with its ids in flight, and the
        # next batch routed, each with the data position before it.
        self.inflight: Optional[tuple[Batch, PendingIds, Any]] = None
        self.queued: list[tuple[Batch, Routed, Any]] = []
        self.dense = build_dense(cfg.model, tc.seed, device)
        set_matmul_precision(tc.dense_precision, device)
        # The dense gradients ride in the embeddings' backward all-to-all (DenseGrads), or DDP all-reduces them.
        self.dense_grads: Optional[DenseGrads] = None
        if st.dense_grad_sync is DenseGradSync.exchange:
            self.dense_grads, self.model = DenseGrads(self.dense), self.dense
        else:
            self.model = DistributedDataParallel(self.dense, **DDP_OPTIONS,
                                                 device_ids=[device.index] if device.type == "cuda" else None)
        self.opt = make_dense_optimizer(self.dense.parameters(), tc.dense_optimizer, tc.dense_learning_rate)
        self.source = source or make_source(cfg, self.rank, self.world,
                                            sizing=PlannedDpp.from_plan(plan.dpp, cfg.dsi), share=self._share,
                                            pin_memory=device.type == "cuda", prefetch_idle=st.prefetch_idle)
        helper = getattr(self.source, "thread_ident", None)
        if helper is not None and device.type == "cpu":   # its CPU time is the step's prefetch lap
            self.sw.watch_helper(helper())
        # ids_exchange=prefetch (CPU ranks): the prefetch thread also exchanges each batch's ids (route, send,
        # receive: TorchRec's input dist, a batch ahead), overlapping the step
        self.ids_ahead = ahead
        if ahead:
            prepare_with = getattr(self.source, "prepare_with", None)
            if prepare_with is None:
                raise ConfigError("strategies.ids_exchange", st.ids_exchange.value,
                                  f"the data source ({type(self.source).__name__}) has no prefetch thread to exchange"
                                  f" the ids in; allowed here: step")
            prepare_with(self.emb.prepare)
        self.losses: list[float] = []
        self.step = 0
        ckpt_root = Path(tc.checkpoint_dir) if tc.checkpoint_dir else (run_dir / "checkpoints" if run_dir else None)
        self.ckpt = (Checkpointer(ckpt_root, self.rank, self.world, group, _fault_step(self.rank, "save"))
                     if ckpt_root else None)

    def _share(self, value: Any) -> Any:
        """Rank 0's value on every rank (collective)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.comm.group)
        return box[0]

    # ------------------------------------------------------------ checkpoint state

    def state(self) -> dict[str, Any]:
        # the data position of the last batch trained (not of a look-ahead batch, which a resume reads again)
        ahead = [self.inflight] if self.inflight is not None else self.queued
        data = self._data_state(ahead[0][2]) if ahead else self.source.state_dict()
        return {"step": self.step, "embeddings": self.emb.shard_state(), "dense": self.dense.state_dict(),
                "dense_optimizer": self.opt.state_dict(), "rng": rng_state(), "data": data,
                "losses": list(self.losses)}

    def restore(self) -> bool:
        if self.ckpt is None:
            return False
        found = self.ckpt.load(self.plan)
        if found is None:
            return False
        step, st = found
        self.emb.load_shard_state(st["embeddings"])
        self.dense.load_state_dict(st["dense"])
        self.opt.load_state_dict(st["dense_optimizer"])
        set_rng_state(st["rng"])
        self.source.load_state_dict(st["data"])
        self.inflight, self.queued = None, []
        self.losses = list(st["losses"])
        self.step = step
        return True

    # ------------------------------------------------------------ steps

    def _data_mark(self) -> Any:
        """The data position before the next batch: a source's cheap local mark where it has one (a DPP client's
        record, made a checkpoint state only at checkpoint steps: no message to a job-wide master per batch),
        else its state_dict."""
        mark = getattr(self.source, "mark", None)
        return mark() if mark is not None else self.source.state_dict()

    def _data_state(self, mark: Any) -> dict[str, Any]:
        """A mark (_data_mark) as the source's checkpoint state (collective for a job-wide DPP service)."""
        state_at = getattr(self.source, "state_at", None)
        return state_at(mark) if state_at is not None else mark

    def _fetch(self, route: bool) -> tuple[Batch, Optional[Routed], Any]:
        """The next batch from the source (and its ids routed), with the data position (a mark) before it."""
        with self.sw("data_wait"):
            state = self._data_mark()
            batch = to_device(self.source.next_batch(), self.device)
        if not route:
            return batch, None, state
        with self.sw("comm_input"):
            return batch, self.emb.route_ids(batch), state

    def _pipelined_batch(self) -> tuple[Batch, LocalLookups]:
        """This step's batch and its lookups, pipelined (TorchRec's TrainPipelineSparseDist): batch s's ids were
        sent during step s-1 and travelled (async, on their own group) while it computed. Batch s+2 is fetched and
        routed here, batch s's ids received, and batch s+1's sent, with their split sizes from batch s's payload
        headers (which carry the next batch's counts) and batch s+2's counts in their own headers: one id
        all-to-all per step. The first step (or the first after a restore) exchanges its counts first."""
        s, steps, sw = self.step, self.cfg.train.steps, self.sw
        if self.inflight is None:
            batch, routed, state = self._fetch(route=True)
            self.queued = [self._fetch(route=True)] if s + 1 < steps else []
            with sw("comm_input"):
                then = self.queued[0][1] if self.queued else None
                self.inflight = (batch, self.emb.send_ids(routed, then=then), state)
        if s + 2 < steps:
            self.queued.append(self._fetch(route=True))
        batch, pending, _ = self.inflight
        with sw("comm_input"):
            lookups = self.emb.finish_ids(pending)
            self.inflight = None
            if self.queued:
                nxt, routed, state = self.queued.pop(0)
                then = self.queued[0][1] if self.queued else None
                self.inflight = (nxt, self.emb.send_ids(routed, lookups.next_counts, then), state)
        return batch, lookups

    def train_step(self) -> tuple[torch.Tensor, StepTimes]:
        sw = self.sw
        sw.times = StepTimes()
        t0 = sw.now()
        if self.strategies.pipeline and not self.ids_ahead:   # (ids_ahead: the batch comes with its lookups)
            batch, lookups = self._pipelined_batch()
        else:
            batch, lookups = self._fetch(route=False)[0], None
        folded = self.dense_grads is not None
        # (strategies.output_overlap: the pooled outputs' all-to-all travels while the bottom MLP runs; DenseArch
        # waits for it)
        pooled = self.emb(batch, lookups, self.dense_grads, pending=self.strategies.output_overlap)
        t_dense = sw.now()
        # folded: the dense backward first, on its own, so that the dense gradients are complete when the
        # embeddings' backward all-to-all carries them
        dense_in = pooled.detach().requires_grad_() if folded else pooled
        with dense_autocast(self.cfg.train.dense_precision, self.device):
            logits = self.model(batch.dense, dense_in)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
        if folded:
            self.dense_grads.zero()
        else:
            self.opt.zero_grad(set_to_none=True)
        sw.grad_arrival = sw.lookups_done = None
        loss.backward()
        if folded:
            pooled.backward(dense_in.grad)
        t_end_bwd = sw.now()
        self.opt.step()
        t_end = sw.now()
        # The TBEs' backward (with the fused update) starts when the pooled-output gradient reaches them and ends
        # when the last of them has run (not at the end of backward(), which also waits for DDP's last all-reduces:
        # those stay in the dense lap, where the estimate prices them); no TBE on this rank: none.
        if sw.grad_arrival is not None:
            sw.span("emb_bwd", sw.grad_arrival, sw.lookups_done if sw.lookups_done is not None else sw.grad_arrival)
        # Dense: forward, backward (with DDP's all-reduce) and the optimizer step, less what the embeddings took
        # (folded: the dense gradients' averaging is in comm_bwd; the replicas' backward runs inside it too, before
        # the exchange's).
        sw.span("dense", t_dense, t_end)
        if isinstance(pooled, PendingPooled):   # its wait (comm_fwd) ran inside the dense span
            sw.exclude("dense", *pooled.wait_marks)
        sw.subtract("dense", "comm_bwd", "emb_bwd", "dp_update", "comm_dp")
        sw.span_step(t0, t_end)
        return loss.detach(), sw.times

    @torch.no_grad()
    def predict(self, batches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out logits and labels of every rank (gathered on all ranks)."""
        source = make_source(self.cfg, self.rank, self.world, eval=True)
        self.dense.eval()
        logits, labels = [], []
        for _ in range(batches):
            batch = to_device(source.next_batch(), self.device)
            with dense_autocast(self.cfg.train.dense_precision, self.device):
                logits.append(self.dense(batch.dense, self.emb(batch)).float())
            labels.append(batch.labels)
        self.dense.train()
        source.close()
        local = torch.stack([torch.cat(logits), torch.cat(labels)]) if logits else torch.zeros(2, 0)
        everyone = self.comm.all_gather(local.float()).cpu()
        return everyone[:, 0].reshape(-1), everyone[:, 1].reshape(-1)

    def run(self, resume: bool, show_progress: bool = True) -> RankResult:
        from tqdm import tqdm

        tc = self.cfg.train
        resumed_from = self.step if (resume and self.restore()) else None
        if resumed_from is not None and self.rank == 0:
            print(f"neocfg: resuming from step {resumed_from:,} of {tc.steps:,} (checkpoints in {self.ckpt.root})")
        if resume and resumed_from is None and self.rank == 0:
            print(f"train.resume=true but no checkpoint in {self.ckpt.root if self.ckpt else '-'}; starting fresh")
        kill_at, hang_at = _fault_step(self.rank), _fault_step(self.rank, "hang")
        local_losses, timed = [], []
        settled: list[float] = []   # this run's global mean losses, up to the last divergence check
        global_batch = tc.batch_size * self.world
        bar = tqdm(total=tc.steps, initial=self.step, disable=not (show_progress and self.rank == 0),
                   unit="step", dynamic_ncols=True)
        t_start = time.perf_counter()
        t_timed = None
        ckpt_s = 0.0
        first = self.step
        while self.step < tc.steps:
            loss, times = self.train_step()
            self.step += 1
            local_losses.append(loss)
            if self.step - first == WARMUP_STEPS:
                t_timed = time.perf_counter() - ckpt_s
            elif self.step - first > WARMUP_STEPS:
                timed.append(times)
            if self.step % tc.log_every == 0 or self.step == tc.steps:
                done = self.step - first
                rate = done * global_batch / (time.perf_counter() - t_start)
                bar.set_postfix(loss=f"{float(loss):.4f}", samples_s=f"{rate:,.0f}")
            bar.update(1)
            if kill_at is not None and self.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if hang_at is not None and self.step == hang_at:
                time.sleep(1e6)
            saving = bool(self.ckpt and tc.checkpoint_every and (self.step % tc.checkpoint_every == 0
                                                                 or self.step == tc.steps))
            if tc.divergence_factor and (saving or self.step % tc.log_every == 0 or self.step == tc.steps):
                # (a diverged state is never saved; every rank sees the same global losses and stops together)
                settled += self._global_losses(local_losses[len(settled):])
                check_divergence(self.losses + settled, len(self.losses), tc.divergence_factor)
            if saving:
                t_ckpt = time.perf_counter()
                self._save_with_losses(settled, local_losses[len(settled):])
                ckpt_s += time.perf_counter() - t_ckpt
        bar.close()
        # Step timing leaves out checkpoint writes (reported separately).
        t_end = time.perf_counter() - ckpt_s
        self.checkpoint_s = ckpt_s
        new_losses = settled + self._global_losses(local_losses[len(settled):])
        self.losses += new_losses
        ev = evaluate(*self.predict(tc.eval_batches)) if tc.eval_batches else None
        return self._report(new_losses, timed, t_start, t_timed, t_end, ev, resumed_from)

    def _global_losses(self, local_losses: list[torch.Tensor]) -> list[float]:
        if not local_losses:
            return []
        t = torch.stack(local_losses).float()
        dist.all_reduce(t, group=self.comm.group)
        return (t / self.world).tolist()

    def _save_with_losses(self, settled: list[float], local_losses: list[torch.Tensor]) -> None:
        saved = self.losses
        self.losses = saved + settled + self._global_losses(local_losses)
        self.ckpt.save(self.step, self.plan, self.state())
        self.losses = saved

    def _report(self, new_losses, timed, t_start, t_timed, t_end, ev, resumed_from) -> RankResult:
        tc, world = self.cfg.train, self.world
        steps_run = len(new_losses)
        self.sw.resolve()   # CUDA: the steps' event times (one synchronize); nothing on CPU
        mean = StepTimes()
        for t in timed:
            for k, v in asdict(t).items():
                mean.add(k, v / len(timed))
        stats = self.source.stats()
        self.source.close()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {"times": asdict(mean), "data": stats}, group=self.comm.group)
        if self.rank != 0:
            return RankResult(self.rank, self.losses)
        if timed and t_timed is not None:
            measured_ms = (t_end - t_timed) * 1e3 / len(timed)
        else:
            measured_ms = (t_end - t_start) * 1e3 / max(steps_run, 1)
        predicted = self.plan.estimate.step_ms
        per_rank = [g["times"] for g in gathered]
        keys = per_rank[0].keys()
        breakdown = {k: sum(r[k] for r in per_rank) / world for k in keys}
        data = aggregate_data_stats([g["data"] or {} for g in gathered])
        if "data_stall_fraction" not in data:  # sources without their own stall clock: wait over step time
            data["data_stall_fraction"] = breakdown["data_wait"] / measured_ms if measured_ms > 0 else 0.0
        emb_compute_ms, emb_comm_ms = self.plan.estimate.embedding_terms_ms(self.plan.devices)
        terms = {
            "embedding_compute": TermMs(emb_compute_ms, breakdown["emb_fwd"] + breakdown["emb_bwd"]
                                        + breakdown["dp_update"]),
            "embedding_comm": TermMs(emb_comm_ms, breakdown["comm_input"] + breakdown["comm_fwd"]
                                     + breakdown["comm_bwd"] + breakdown["comm_dp"]),
            "dense": TermMs(self.plan.estimate.dense_ms, breakdown["dense"]),
            # producing the batches: the prefetch thread's CPU time in the step where it was watched (CPU ranks),
            # else its production time beside the step, or the wait for it
            "data": TermMs(self.plan.estimate.data_ms, breakdown["prefetch"] if self.sw.watching
                           else produce_ms(data, breakdown, world, steps_run))}
        if self.emb.replicated.tables:   # the data-parallel tables' backward, inside the embedding terms above
            terms |= {"dp_update": TermMs(self.plan.estimate.dp_update_ms, breakdown["dp_update"]),
                      "dp_all_reduce": TermMs(self.plan.estimate.dp_all_reduce_ms, breakdown["comm_dp"])}
        last = self.losses[-10:]
        metrics = RunMetrics(
            model=self.cfg.model.name, world_size=world, batch_size_per_rank=tc.batch_size,
            global_batch=tc.batch_size * world, steps=self.step, steps_this_run=steps_run,
            resumed_from_step=resumed_from, samples=self.step * tc.batch_size * world,
            samples_per_s=(tc.batch_size * world * 1e3 / measured_ms) if measured_ms > 0 else 0.0,
            wall_s=t_end - t_start + self.checkpoint_s, checkpoint_s=self.checkpoint_s,
            initial_loss=self.losses[0] if self.losses else None, final_loss=self.losses[-1] if self.losses else None,
            final_loss_mean_last_10=sum(last) / len(last) if last else None, losses=list(self.losses),
            max_loss=max(self.losses) if self.losses else None,
            max_loss_step=self.losses.index(max(self.losses)) + 1 if self.losses else None,
            eval_samples=ev.samples if ev else 0, eval_logloss=ev.logloss if ev else None,
            eval_ne=ev.ne if ev else None, eval_auc=ev.auc if ev else None, eval_ctr=ev.ctr if ev else None,
            breakdown_ms=breakdown, breakdown_ms_per_rank=per_rank, timed_steps=len(timed),
            warmup_steps=WARMUP_STEPS, predicted_step_ms=predicted, measured_step_ms=measured_ms,
            plan_batch_size_per_device=self.plan.batch_size_per_device, predicted_vs_measured_ms=terms,
            prediction_error=((measured_ms - predicted) / predicted) if predicted else None,
            a2a_fwd_dtype=self.plan.a2a_fwd_dtype.value, a2a_bwd_dtype=self.plan.a2a_bwd_dtype.value,
            sparse_optimizer=tc.sparse_optimizer.value, dense_optimizer=tc.dense_optimizer.value,
            plan_solver=self.plan.solver.algorithm, data=data, data_per_rank=[g["data"] for g in gathered],
            # the data pipeline's contract: stall, delivery and DPP counters over all ranks
            data_stall_fraction=data["data_stall_fraction"], samples_delivered=data.get("samples_delivered", 0),
            duplicate_samples=data.get("duplicate_samples", 0),
            dpp=DppCounters(backend=(gathered[0]["data"] or {}).get("dpp.backend"),
                            workers=data.get("dpp.workers", 0), worker_restarts=data.get("dpp.worker_restarts", 0),
                            bytes_read=data.get("dpp.bytes_read", 0)))
        return RankResult(0, self.losses, metrics)


def check_divergence(losses: list[float], checked: int, factor: float) -> None:
    """DivergedError at the first of losses[checked:] (global mean loss per step, step i + 1) that is NaN/inf or more
    than factor times losses[0]."""
    first = losses[0] if losses else 0.0
    for i in range(checked, len(losses)):
        loss = losses[i]
        if not math.isfinite(loss) or (math.isfinite(first) and loss > factor * first):
            why = "is not finite" if not math.isfinite(loss) else f"is more than {factor:g}x the first loss {first:.4g}"
            raise DivergedError(
                f"training diverged at step {i + 1}: loss {loss:.4g} {why} (train.divergence_factor={factor:g}); "
                f"lower train.dense_learning_rate / train.sparse_learning_rate (checkpoints written before step "
                f"{i + 1} are kept)")


def produce_ms(data: dict[str, Any], breakdown: dict[str, float], world: int, steps: int) -> float:
    """Milliseconds per step and rank the data source spent producing batches: its own clock where it prefetches
    (data_produce_seconds, summed over ranks; the production overlaps the step and, on CPU ranks, competes with
    it), else the time the step waited for it."""
    if "data_produce_seconds" in data and steps:
        return data["data_produce_seconds"] * 1e3 / world / steps
    return breakdown["data_wait"]


def aggregate_data_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Combine the data sources' per-rank stats: fractions are averaged over ranks, counters and seconds summed."""
    out: dict[str, Any] = {}
    numeric = [{k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
               for d in per_rank]
    for key in dict.fromkeys(k for d in numeric for k in d):
        values = [d[key] for d in numeric if key in d]
        out[key] = sum(values) / len(values) if key.endswith("_fraction") else sum(values)
    return out


def train_rank(cfg: NeocfgConfig, plan: Plan, run_dir: Optional[Path], device: torch.device,
               show_progress: bool = True) -> RankResult:
    """Run cfg.train on this rank of an initialized process group."""
    trainer = Trainer(cfg, plan, run_dir, device)
    return trainer.run(cfg.train.resume, show_progress)
