"""Schema of the `planner` section: which algorithm, its limits, what it may choose, comm precision, cost constants."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import List, Optional

from neocfg.config import checks
from neocfg.types import CommDtype, MemoryTier, MipSolver, PlanExport, PlannerAlgorithm, ShardingType, WeightsDtype


@dataclass
class CostConstants:
    """Empirical factors of the planner's cost model (`planner.costs.<name>=...` overrides any of them).

    Each is a named constant with its justification; all are dimensionless unless the name carries a unit.
    """

    # Fraction of peak HBM bandwidth a fused embedding lookup (fbgemm TBE) reaches on random row gathers: TBE
    # forward reaches about half of the A100's 1.55 TB/s at D=128 (Neo, ISCA'22, section 5.1 / fig. 9). Also taken
    # for random row gathers from host DDR (UVM cache misses, host-resident tables: hardware.host.ddr_bandwidth_gbs).
    hbm_efficiency: float = 0.5
    # Fraction of PCIe bandwidth reached by UVM reads of scattered rows (cache misses, host-resident tables): small
    # random transactions over PCIe run at roughly a quarter of the streaming rate (Neo section 5.2, UVM caching).
    pcie_efficiency: float = 0.25
    # Backward pass with the fused optimizer as a multiple of the forward lookup: it reads the gradient, reads and
    # writes the rows and the optimizer state (TorchRec planner's BWD_COMPUTE_MULTIPLIER is 2 as well).
    bwd_compute_multiplier: float = 2.0
    # Fraction of link bandwidth NCCL collectives reach at embedding message sizes (hundreds of KB to MB per peer),
    # nccl-tests all-to-all busbw on NVLink / RoCE is typically 60-80 % of the line rate.
    comm_efficiency: float = 0.7
    # Fraction of the device's peak FLOP/s the dense MLPs reach in training (model FLOPs utilization; MLPerf DLRM
    # submissions on A100 report 30-50 %).
    dense_mfu: float = 0.4
    # Fixed cost per embedding shard per step (microseconds): index bookkeeping, bucketization and small kernels
    # that run per table even inside a fused TBE (TorchRec's planner adds a similar per-shard overhead).
    shard_overhead_us: float = 5.0
    # Host-side work per step counted in kernels (ops), each costing hardware.device.kernel_overhead_us:
    # Kernels per dense linear layer per training step: addmm and activation forward; input-gradient matmul,
    # weight-gradient matmul, bias-gradient sum and activation gradient backward (counted in torch's autograd graph).
    dense_kernels_per_layer: float = 6.0
    # Kernels per step of the dense part outside its linear layers: interaction (bmm, triangle index, cat) forward
    # and backward, BCE loss and its gradient, zero_grad, DDP's bucket copies, the optimizer's foreach update.
    dense_step_kernels: float = 30.0
    # Passes over the dense part's activations per training step (every layer's input and output and the
    # interaction's, fp32, per sample), at the device's streaming bandwidth (hardware.device.stream_bandwidth_gbs):
    # the elementwise work a FLOP count misses (activations, their gradients, concatenations, DCN's cross product),
    # which dominates a wide interaction. Fitted on cpu_local's training steps (bench/calibrate_step.py --fit over two
    # sweeps of its 16 runs, 0.5-30 MB of activations per step: 6.83); on a GPU it is small next to the FLOPs.
    dense_activation_passes: float = 6.83
    # Kernels per step of the pooled-output exchange on every device, forward and backward (neocfg/runtime/dist.py
    # EmbeddingExchange, counted for the all-to-all kind: cast, reshape, the received pieces gathered
    # into the output in one ChunkGather, view forward; the gradient's scale, gather, casts and view backward; about
    # 12). The id routing is its own term (hardware.device.routing_us_per_step).
    embedding_step_kernels: float = 12.0
    # Kernels (ops) of the id routing per step (neocfg/runtime/routing.py IdRouter for whole-table pieces: route ~12,
    # start ~12 (the counts' all-to-all, split sizes, the host sync), receive ~16), charged as kernel_overhead_us each
    # where hardware.device.routing_us_per_step is unset (the GPU presets).
    router_kernels_per_step: float = 40.0
    # Passes over a data-parallel replica's fp32 elements per step (neocfg/runtime/replicated.py, counted: the dense
    # TBE's gradient zeroed and scattered, scaled, all-reduced in place, squared and summed per row, the update read
    # and written: about 12), at the device's streaming bandwidth (hardware.device.stream_bandwidth_gbs).
    replica_update_passes: float = 12.0
    # Kernels per fused lookup group (one TBE per weights precision x memory tier on a device) per step: the TBE
    # forward, its backward with the fused optimizer, the output concatenation and its gradient.
    tbe_kernels_per_group: float = 4.0
    # Size of one DDP gradient bucket (MiB): DDP issues one all-reduce per bucket (torch's bucket_cap_mb default).
    ddp_bucket_mib: float = 25.0
    # Bytes of cache metadata per cached row of a UVM-cached table (fbgemm lxu_cache_state int64 + LRU timestamp).
    cache_metadata_bytes_per_row: int = 16
    # Fraction of device memory kept free for the CUDA context, allocator fragmentation and dense activations.
    hbm_reserve_fraction: float = 0.1
    # Fraction of host DDR kept free for the OS, data loading and pinned staging buffers.
    host_reserve_fraction: float = 0.2
    # Weight of total communication time (ms summed over devices) in the ILP objective: a tie-breaker among
    # plans with the same step time, small enough not to trade step time for it.
    comm_tiebreak: float = 1e-4
    # Times a DPP worker's memory system moves each byte of a sample (NIC DMA in, decompress/decode, transform,
    # serialize + DMA out); DSI (Zhao et al., ISCA'22, section 5) finds memory bandwidth a DPP bottleneck next to
    # CPU and NIC.
    dpp_memory_passes: float = 4.0

    def check(self, key: str) -> None:
        for name in ("hbm_efficiency", "pcie_efficiency", "comm_efficiency", "dense_mfu"):
            checks.in_range(f"{key}.{name}", getattr(self, name), 0.0, 1.0, lo_open=True)
        checks.in_range(f"{key}.hbm_reserve_fraction", self.hbm_reserve_fraction, 0.0, 1.0, hi_open=True)
        checks.in_range(f"{key}.host_reserve_fraction", self.host_reserve_fraction, 0.0, 1.0, hi_open=True)
        checks.positive(f"{key}.bwd_compute_multiplier", self.bwd_compute_multiplier)
        checks.positive(f"{key}.dpp_memory_passes", self.dpp_memory_passes)
        checks.positive(f"{key}.ddp_bucket_mib", self.ddp_bucket_mib)
        for name in ("dense_kernels_per_layer", "dense_step_kernels", "dense_activation_passes",
                     "embedding_step_kernels", "router_kernels_per_step", "replica_update_passes", "tbe_kernels_per_group"):
            checks.non_negative(f"{key}.{name}", getattr(self, name))
        for name in ("shard_overhead_us", "cache_metadata_bytes_per_row", "comm_tiebreak"):
            checks.non_negative(f"{key}.{name}", getattr(self, name))

    @staticmethod
    def names() -> list[str]:
        return [f.name for f in fields(CostConstants)]


@dataclass
class PlannerConfig:
    algorithm: PlannerAlgorithm = PlannerAlgorithm.ilp
    # The MIP solver of algorithm=ilp: cbc (PuLP's bundled CBC) or highs (highspy); bench/bench_planner.py --solvers
    # measures both side by side.
    solver: MipSolver = MipSolver.cbc
    # Wall-clock limit for the ILP solver and the relative gap at which it may stop.
    time_limit_s: float = 45.0
    mip_gap: float = 0.01
    # Use a saved plan.json instead of planning (mode=train); mode=plan validates and rates it without solving.
    plan_file: Optional[str] = None
    # Also write the plan in another system's format (mode=plan): torchrec -> torchrec_plan.json.
    export: Optional[PlanExport] = None
    # What the planner may choose, for every table (a table's own lists narrow these further).
    sharding_types: List[ShardingType] = field(default_factory=lambda: list(ShardingType))
    memory_tiers: List[MemoryTier] = field(default_factory=lambda: list(MemoryTier))
    weights_dtypes: List[WeightsDtype] = field(default_factory=lambda: [WeightsDtype.fp32])
    # Weight dtypes a data-parallel replica may be stored in: neocfg's runtime keeps replicas in fp32
    # (runtime/replicated.py); a plan TorchRec's runtime executes may hold fp16 replicas (its DP tables keep their dtype).
    replica_dtypes: List[WeightsDtype] = field(default_factory=lambda: [WeightsDtype.fp32])
    # Bytes of the dense part's parameters and optimizer state on every device when measured elsewhere (the TorchRec
    # interop measures the module); None: computed from the model's MLPs and train.dense_optimizer.
    dense_resident_bytes: Optional[int] = None
    # Fraction of a UVM-cached table's rows held in the HBM cache.
    cache_ratio: float = 0.2
    # Precision of the embedding all-to-all, forward (pooled outputs) and backward (their gradients).
    a2a_fwd_dtype: CommDtype = CommDtype.fp32
    a2a_bwd_dtype: CommDtype = CommDtype.fp32
    # Most column slices a column-wise / table-column-wise table is cut into (each slice >= 4 columns).
    max_column_slices: int = 8
    # Instances with at most this many (table option x device) placement variables are solved as one flat,
    # exact ILP; larger ones by decomposition (aggregated option choice, then placement).
    exact_max_variables: int = 2000
    # The cost model's empirical factors.
    costs: CostConstants = field(default_factory=CostConstants)

    def check(self, key: str = "planner") -> None:
        checks.positive(f"{key}.time_limit_s", self.time_limit_s)
        checks.in_range(f"{key}.mip_gap", self.mip_gap, 0.0, 1.0)
        checks.non_empty(f"{key}.sharding_types", self.sharding_types)
        checks.non_empty(f"{key}.memory_tiers", self.memory_tiers)
        checks.non_empty(f"{key}.weights_dtypes", self.weights_dtypes)
        checks.non_empty(f"{key}.replica_dtypes", self.replica_dtypes)
        if self.dense_resident_bytes is not None:
            checks.non_negative(f"{key}.dense_resident_bytes", self.dense_resident_bytes)
        checks.in_range(f"{key}.cache_ratio", self.cache_ratio, 0.0, 1.0, lo_open=True)
        checks.positive(f"{key}.max_column_slices", self.max_column_slices)
        checks.non_negative(f"{key}.exact_max_variables", self.exact_max_variables)
        self.costs.check(f"{key}.costs")
