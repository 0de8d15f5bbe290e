"""Schema of the `hardware` group: the cluster topology, device memory and bandwidths.

Units are in the field names: capacities in GiB, bandwidths in GB/s (10^9 bytes per second), compute in TFLOP/s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from neocfg.config import checks
from neocfg.errors import ConfigError
from neocfg.types import Backend, DensePrecision, DeviceKind


@dataclass
class DeviceConfig:
    kind: DeviceKind = DeviceKind.gpu
    model: str = "generic"
    # Fast device memory (HBM on a GPU; the per-rank memory budget on a CPU rank).
    hbm_gib: float = MISSING
    hbm_bandwidth_gbs: float = MISSING
    # Dense peak in fp32 (before efficiency factors); the TF32 and BF16 tensor-core peaks when the device has them
    # (unset: no faster than fp32). The planner uses the one of train.dense_precision.
    peak_tflops: float = 100.0
    peak_tflops_tf32: Optional[float] = None
    peak_tflops_bf16: Optional[float] = None
    # Fixed host-side cost of one kernel (op) in the training step, microseconds: launch on a GPU (~5 us, CUDA
    # kernel launch latency; mostly overlapped, kept as the exposed part), eager op dispatch on a CPU rank.
    kernel_overhead_us: float = 5.0
    # Fixed host time of the dense part per training step whatever its layers, microseconds (a CPU rank: the autograd
    # engine's walk, the optimizer's step, the loss: a 4-layer and a 7-layer MLP pay alike); unset: its kernels x
    # kernel_overhead_us (planner.costs.dense_kernels_per_layer per layer + dense_step_kernels: the GPU presets).
    # cpu_local: measured in a training step (calibrate_step.py's dense fit).
    dense_fixed_us: Optional[float] = None
    # Host time of the runtime's id routing (neocfg/runtime/routing.py IdRouter: a constant number of vectorized ops
    # per step whatever the number of tables and pieces, plus passes over the ids), microseconds per step; unset:
    # planner.costs.router_kernels_per_step x kernel_overhead_us (its ops' launches: the GPU presets).
    # cpu_local: measured in a training step (bench/calibrate_cpu.py --only train).
    routing_us_per_step: Optional[float] = None
    # ... and per id the device receives (sort by destination, permutes, bincount), nanoseconds; 0 on the GPU presets
    # (passes at HBM speed, small next to the id all-to-all); cpu_local: measured (calibrate_cpu.py --only router).
    routing_ns_per_id: float = 0.0
    # ... and more per id of a row-sharded piece (bucketized by row range and rebased: passes a whole-table id does
    # not take), nanoseconds; 0 on the GPU presets. cpu_local: measured in a training step (calibrate_cpu.py --only
    # step_terms: the prefetch thread's CPU time of row-wise runs beyond the batch's generation).
    routing_ns_per_row_id: float = 0.0
    # Host time of one fused lookup group's (TBE's) call per step beyond its bytes: forward, and backward with the fused
    # optimizer, microseconds; unset: planner.costs.tbe_kernels_per_group x kernel_overhead_us (the GPU presets: their
    # kernels' launches). cpu_local: measured (calibrate_cpu.py --only tbe, the fit's intercept).
    tbe_us_per_group: Optional[float] = None
    # ... and per bag (one sample's ids of one table) a TBE walks, forward + backward, nanoseconds: fbgemm's CPU
    # kernels visit every bag of every table, so a piece of many bags costs more than its rows' bytes; 0 on the GPU
    # presets (a thread per bag, hidden in the bytes term). cpu_local: measured in a training step
    # (calibrate_cpu.py --only step_terms).
    tbe_ns_per_bag: float = 0.0
    # ... and per column of each bag, nanoseconds: the pooled value it writes forward and whose gradient it reads and
    # scatters back backward (a dim-64 bag costs more than a dim-8 one); 0 on the GPU presets. cpu_local: measured in
    # a training step (calibrate_step.py, its calibration models of dims 8-64).
    tbe_ns_per_bag_column: float = 0.0
    # ... and per distinct row a TBE looks up in a step, nanoseconds: the row fetched once (its repeats hit the
    # processor cache) and its fused optimizer update, once per row whatever its ids (fbgemm's CPU backward
    # aggregates a row's gradients first); distinct rows among the step's ids by the table's Zipf law
    # (planner.costs.distinct_fraction). 0 on the GPU presets. cpu_local: measured in a training step
    # (calibrate_step.py).
    tbe_ns_per_row: float = 0.0
    # ... and more per 64-byte line of each distinct row of a piece whose rows span more than table_reach_mib (a
    # narrower row: one line), nanoseconds, scaled by the share of the span beyond it (1 - table_reach_mib / the
    # piece's MiB): the address translation and caches that serve a small table's rows (fbgemm walks the tables one
    # after another) do not reach a large one's, and a wide row's lines miss one by one. 0 on the GPU presets.
    # cpu_local: measured in a training step (calibrate_step.py: tables of 1-256 MB, rows of 32-256 bytes, the
    # reach the best of 0.5-32 MiB).
    tbe_ns_per_far_line: float = 0.0
    table_reach_mib: float = 0.0
    # A CPU rank's share of the processor caches, MiB, and the rate of the lookups they serve, GB/s: on device memory a
    # lookup reads its row from the cache when the row is among the hottest cache_mib x world / the model's fp32
    # weights of its table (the Zipf hit rate), else at hbm_bandwidth_gbs. 0: no cache (the GPU presets: HBM rows
    # are read once per lookup). cpu_local: fitted to training steps of uniform and skewed ids (calibrate_step.py).
    cache_mib: float = 0.0
    cache_bandwidth_gbs: Optional[float] = None
    # Streaming bandwidth of the device's memory for dense passes (a data-parallel replica's gradient and update,
    # neocfg/runtime/replicated.py), GB/s; unset: hbm_bandwidth_gbs. cpu_local: measured (--only replica_update).
    stream_bandwidth_gbs: Optional[float] = None
    # Rate of the host copies around each byte of the embedding exchange (dtype casts, split / cat, index_select /
    # index_add, forward and backward), GB/s, on top of the collective's own bandwidth; unset: free (on a GPU
    # they run at HBM speed). cpu_local: measured.
    exchange_copy_gbs: Optional[float] = None
    # The same for each byte of the exchange's reduce-scatters and all-gathers (row-wise outputs' partial sums and
    # their gradients: the host also sums what it receives), GB/s; unset: exchange_copy_gbs. cpu_local: measured.
    gather_copy_gbs: Optional[float] = None
    # ... and for each byte of the row-wise partial sums' all-to-all (StepStrategies.sums_by_all_to_all: no layout
    # gather around it, one sum of what arrives), GB/s; unset: exchange_copy_gbs. cpu_local: measured.
    sums_copy_gbs: Optional[float] = None
    # ... and the exchange's host time per bag (one sample's pooled value of one table) its outputs carry, forward +
    # backward, nanoseconds, beside their bytes: the outputs travel as one segment per bag, and narrow segments cost
    # more per byte than wide ones; 0: not charged (the GPU presets). cpu_local: measured.
    exchange_ns_per_bag: float = 0.0
    # Fraction of peak_tflops the dense MLPs reach in training on this device; unset: planner.costs.dense_mfu (a
    # GPU's model FLOPs utilization). A CPU rank's marginal GEMM rate is its peak once kernel_overhead_us is apart.
    dense_mfu: Optional[float] = None

    def check(self, key: str) -> None:
        checks.positive(f"{key}.hbm_gib", self.hbm_gib)
        checks.positive(f"{key}.hbm_bandwidth_gbs", self.hbm_bandwidth_gbs)
        checks.positive(f"{key}.peak_tflops", self.peak_tflops)
        for sub in ("peak_tflops_tf32", "peak_tflops_bf16"):
            if getattr(self, sub) is not None:
                checks.positive(f"{key}.{sub}", getattr(self, sub))
        checks.non_negative(f"{key}.kernel_overhead_us", self.kernel_overhead_us)
        if self.dense_fixed_us is not None:
            checks.non_negative(f"{key}.dense_fixed_us", self.dense_fixed_us)
        if self.routing_us_per_step is not None:
            checks.non_negative(f"{key}.routing_us_per_step", self.routing_us_per_step)
        checks.non_negative(f"{key}.routing_ns_per_id", self.routing_ns_per_id)
        checks.non_negative(f"{key}.routing_ns_per_row_id", self.routing_ns_per_row_id)
        if self.tbe_us_per_group is not None:
            checks.non_negative(f"{key}.tbe_us_per_group", self.tbe_us_per_group)
        checks.non_negative(f"{key}.tbe_ns_per_bag", self.tbe_ns_per_bag)
        checks.non_negative(f"{key}.tbe_ns_per_bag_column", self.tbe_ns_per_bag_column)
        checks.non_negative(f"{key}.tbe_ns_per_row", self.tbe_ns_per_row)
        checks.non_negative(f"{key}.tbe_ns_per_far_line", self.tbe_ns_per_far_line)
        checks.non_negative(f"{key}.table_reach_mib", self.table_reach_mib)
        checks.non_negative(f"{key}.cache_mib", self.cache_mib)
        if self.cache_mib > 0 and self.cache_bandwidth_gbs is None:
            raise ConfigError(f"{key}.cache_bandwidth_gbs", ConfigError.NO_VALUE,
                              f"required when {key}.cache_mib is above 0 (it is {self.cache_mib}): the rate of the "
                              "lookups the cache serves, GB/s")
        if self.cache_bandwidth_gbs is not None:
            checks.positive(f"{key}.cache_bandwidth_gbs", self.cache_bandwidth_gbs)
        if self.stream_bandwidth_gbs is not None:
            checks.positive(f"{key}.stream_bandwidth_gbs", self.stream_bandwidth_gbs)
        if self.exchange_copy_gbs is not None:
            checks.positive(f"{key}.exchange_copy_gbs", self.exchange_copy_gbs)
        if self.gather_copy_gbs is not None:
            checks.positive(f"{key}.gather_copy_gbs", self.gather_copy_gbs)
        if self.sums_copy_gbs is not None:
            checks.positive(f"{key}.sums_copy_gbs", self.sums_copy_gbs)
        checks.non_negative(f"{key}.exchange_ns_per_bag", self.exchange_ns_per_bag)
        if self.dense_mfu is not None:
            checks.in_range(f"{key}.dense_mfu", self.dense_mfu, 0.0, 1.0, lo_open=True)


    def peak_tflops_at(self, precision: DensePrecision) -> float:
        """Dense peak at a training precision; a precision without its own peak runs no faster than fp32."""
        own = {DensePrecision.fp32: self.peak_tflops, DensePrecision.tf32: self.peak_tflops_tf32,
               DensePrecision.bf16: self.peak_tflops_bf16}[precision]
        return self.peak_tflops if own is None else own


@dataclass
class HostConfig:
    ddr_gib: float = MISSING
    ddr_bandwidth_gbs: float = MISSING
    cpu_cores: int = 64
    # Host-to-device bandwidth used by UVM caching and host-resident tables (PCIe).
    pcie_bandwidth_gbs: float = 25.0
    # Host time to generate a rank's synthetic batch (neocfg/data/synthetic.py; dsi.source=synthetic): microseconds
    # per sample, nanoseconds per id and per bag (a sample's ids of one table) of the sample, microseconds per batch. Charged to the step only on CPU devices,
    # whose ranks are the host's cores (the trainer's prefetch thread competes with its rank); a GPU's host prepares
    # the next batch on cores of its own. Unset: not charged. cpu_local: measured in a training step
    # (bench/calibrate_cpu.py --only train).
    synthetic_us_per_sample: Optional[float] = None
    synthetic_ns_per_id: float = 0.0
    synthetic_ns_per_bag: float = 0.0
    synthetic_us_per_batch: float = 0.0
    # The batch's ids and bags cost less each the more of them a batch holds (the generator's numpy passes run over
    # whole blocks: per-call costs spread over more items): their time grows as count ** synthetic_exponent, the per-id
    # and per-bag rates being those at planner.costs.SYNTHETIC_REF_ITEMS items; 1: linear. cpu_local: measured in a
    # training step (calibrate_step.py: the exponent of 0.7-1 that fits best).
    synthetic_exponent: float = 1.0

    def check(self, key: str) -> None:
        checks.positive(f"{key}.ddr_gib", self.ddr_gib)
        checks.positive(f"{key}.ddr_bandwidth_gbs", self.ddr_bandwidth_gbs)
        checks.positive(f"{key}.cpu_cores", self.cpu_cores)
        checks.positive(f"{key}.pcie_bandwidth_gbs", self.pcie_bandwidth_gbs)
        if self.synthetic_us_per_sample is not None:
            checks.non_negative(f"{key}.synthetic_us_per_sample", self.synthetic_us_per_sample)
        checks.non_negative(f"{key}.synthetic_ns_per_id", self.synthetic_ns_per_id)
        checks.non_negative(f"{key}.synthetic_ns_per_bag", self.synthetic_ns_per_bag)
        checks.non_negative(f"{key}.synthetic_us_per_batch", self.synthetic_us_per_batch)
        checks.in_range(f"{key}.synthetic_exponent", self.synthetic_exponent, 0.0, 1.0, lo_open=True)


@dataclass
class HardwareConfig:
    name: str = MISSING
    nodes: int = 1
    devices_per_node: int = 2
    # Optional; when given it must equal nodes * devices_per_node.
    world_size: Optional[int] = None
    backend: Backend = Backend.gloo
    device: DeviceConfig = field(default_factory=DeviceConfig)
    host: HostConfig = field(default_factory=HostConfig)
    # Per-device bandwidth within a node (NVLink) and across nodes (the device's share of the RDMA NICs).
    intra_node_bandwidth_gbs: float = MISSING
    inter_node_bandwidth_gbs: float = MISSING
    # Fixed time of one collective whatever its size (alpha of the alpha-beta model), microseconds: a property of
    # the backend and interconnect (NCCL over NVLink ~10-30 us, over RDMA across nodes more; gloo over loopback TCP
    # ~0.1-1 ms). The default is NCCL's small-message all-to-all latency within a node (nccl-tests).
    collective_latency_us: float = 25.0
    # Fixed time of the data-parallel tables' gradient all-reduce in a training step (neocfg/runtime/replicated.py:
    # one all-reduce, on a group of its own, inside backward), microseconds; unset: collective_latency_us (NCCL's
    # small-message all-reduce within a node is no slower than its all-to-all). cpu_local: measured (gloo's ring
    # all-reduce is two dependent exchanges, a reduce-scatter then an all-gather, each waking the peer's thread).
    all_reduce_latency_us: Optional[float] = None
    # Fixed time of one of DDP's dense-gradient all-reduces in a training step (its bucket all-reduces, on the default
    # group, behind the dense backward), microseconds; unset: collective_latency_us. The ranks reach them together
    # (the same dense work since the last all-to-all): no wait for a late peer in it.
    ddp_latency_us: Optional[float] = None
    # What a plan whose dense gradients DDP syncs, and which waits for its output exchange (no output overlap), adds to
    # that exchange's backward: it waits behind DDP's first bucket all-reduce (the gradients of the layers above the
    # embeddings, ready before it, in flight on the same core), microseconds per step, in the estimate and the objective
    # (not the bound); unset: 0. cpu_local: measured (bench/calibrate_step.py).
    ddp_exchange_wait_us: Optional[float] = None
    # Fixed time of one reduce-scatter or all-gather of the embedding exchange in a training step (the row-wise
    # outputs' partial sums and their gradients, the two-level exchange's node collectives), microseconds; unset:
    # collective_latency_us. cpu_local: measured (bench/calibrate_step.py fits it beside the all-to-all's).
    reduce_scatter_latency_us: Optional[float] = None
    # Share (0..1) of the pooled outputs' all-to-all (its latency + its bytes at the link rate, each way) that can run
    # while the bottom MLP computes, where the plan sends it before that MLP (StepStrategies.output_overlap): the
    # estimate and the solver take off min(this x (latency + wire time), the bottom MLP's compute). 1.0: the
    # collective progresses on its own (NCCL: its own stream and SMs); 0: it progresses only when the rank waits.
    output_overlap_efficiency: float = 1.0

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def check(self, key: str = "hardware") -> None:
        checks.non_empty(f"{key}.name", self.name)
        checks.positive(f"{key}.nodes", self.nodes)
        checks.positive(f"{key}.devices_per_node", self.devices_per_node)
        if self.world_size is not None and self.world_size != self.num_devices:
            raise ConfigError(
                f"{key}.world_size", self.world_size,
                f"must equal hardware.nodes x hardware.devices_per_node = {self.nodes} x {self.devices_per_node}"
                f" = {self.num_devices}")
        self.device.check(f"{key}.device")
        self.host.check(f"{key}.host")
        checks.positive(f"{key}.intra_node_bandwidth_gbs", self.intra_node_bandwidth_gbs)
        checks.positive(f"{key}.inter_node_bandwidth_gbs", self.inter_node_bandwidth_gbs)
        checks.non_negative(f"{key}.collective_latency_us", self.collective_latency_us)
        if self.all_reduce_latency_us is not None:
            checks.non_negative(f"{key}.all_reduce_latency_us", self.all_reduce_latency_us)
        if self.ddp_latency_us is not None:
            checks.non_negative(f"{key}.ddp_latency_us", self.ddp_latency_us)
        if self.ddp_exchange_wait_us is not None:
            checks.non_negative(f"{key}.ddp_exchange_wait_us", self.ddp_exchange_wait_us)
        if self.reduce_scatter_latency_us is not None:
            checks.non_negative(f"{key}.reduce_scatter_latency_us", self.reduce_scatter_latency_us)
        checks.in_range(f"{key}.output_overlap_efficiency", self.output_overlap_efficiency, 0.0, 1.0)
        if self.backend is Backend.nccl and self.device.kind is DeviceKind.cpu:
            raise ConfigError(f"{key}.backend", "nccl", "nccl needs hardware.device.kind=gpu; use gloo on CPU")
