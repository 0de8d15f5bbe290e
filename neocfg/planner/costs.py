"""Cost models: memory, compute and communication of one piece of a sharded table, and of the dense part.

Notation (per step): B samples per device, W devices (world), P devices per node, G = B x W samples globally,
L the table's pooling factor, D its dimension, c the columns of a slice, r the rows of a shard.

Compute  lookup bytes / effective bandwidth of the tier (HBM, where a CPU rank's processor cache serves the hottest
         hardware.device.cache_mib of each table's rows at cache_bandwidth_gbs, `cache_fraction`; UVM caching mixes HBM hits and misses read from host DDR
         over PCIe; host-tier reads the same way: the slower of the PCIe link and the device's share of the host's DDR
         bandwidth, hardware.host.ddr_bandwidth_gbs / devices_per_node); backward with the fused optimizer = `bwd_compute_multiplier` x forward;
         plus hardware.device.tbe_ns_per_bag per bag (output sample) a piece pools, tbe_ns_per_bag_column per column
         of each bag (its pooled value and gradient), tbe_ns_per_row per distinct row its ids address in a step
         (`distinct_fraction`), tbe_ns_per_far_line more per 64-byte line of such a row (`row_lines`) of a piece
         spanning more than hardware.device.table_reach_mib (`far_share`), and tbe_us_per_group per fused lookup
         group.
Comm     the records a piece adds to the step's collectives (its Scheme's piece_comms: the list the runtime issues,
         neocfg.sharding.collectives), each at the holder's bytes: all-to-all from/to every device: bytes x
         (fraction within the node / intra bandwidth + fraction across nodes / inter bandwidth); cross-node
         all-to-all over the inter-node link; reduce-scatter / all-gather / all-reduce hierarchically (within the
         node, then 1/P of the data across nodes). All divided by `comm_efficiency`. Ids travel in the id dtype the
         plan's strategies will choose (planned_id_dtype), with their lengths (or bag codes). The exchange's host
         copies cost hardware.device.exchange_copy_gbs per byte (gather_copy_gbs for its reduce-scatters and
         all-gathers) and exchange_ns_per_bag per bag a piece's outputs carry (`bag_copies_ms`).
Overhead fixed costs the byte and FLOP terms miss, which dominate small models and CPU ranks: every collective
         costs hardware.collective_latency_us (alpha) on top of its bytes (beta), the exchange's reduce-scatters and
         all-gathers hardware.reduce_scatter_latency_us where given; every kernel (op) costs
         hardware.device.kernel_overhead_us. Counted per step from what the runtime issues: embedding collectives by
         the sharding types in the plan and the step's id exchange (`embedding_collectives`, step_id_collectives; the data-parallel gradient all-reduce at
         hardware.all_reduce_latency_us, `collectives_latency_ms`), the id routing (a constant number of ops per step,
         hardware.device.routing_us_per_step, plus routing_ns_per_id per id received), kernels of the output exchange
         and around the fused lookups (`embedding_overhead_ms`), kernels per dense layer and DDP buckets
         (`dense_cost`). Data-parallel replicas also pass over their whole fp32 table every step (gradient and
         update; `replica_update_ms`).
Data     on CPU devices (the ranks are the host's cores) the trainer's synthetic batches are generated on the rank's
         core: hardware.host.synthetic_us_per_sample per sample, _ns_per_id per id, _ns_per_bag per bag,
         _us_per_batch (`data_ms`); a GPU's host has cores of its own. Where the plan exchanges the ids in the
         prefetch thread, the id routing (`routed_ms`, routing_us_per_step) is charged here instead of to comm
         (planner/assemble.py).
Dense    FLOPs at peak x MFU, planner.costs.dense_activation_passes over the activations (`dense_activations`) at
         the streaming bandwidth, kernels (or hardware.device.dense_fixed_us per step), and DDP's all-reduce unless
         the plan folds the dense gradients into the embeddings' backward all-to-all (`dense_cost`).
Memory   weights at the precision + optimizer state (row-wise Adagrad one fp32 per row, Adagrad one per element,
         SGD none) + cache metadata (UVM caching) + input/output buffers (ids, pooled outputs and their gradients).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from neocfg.config.model import ModelConfig, TableConfig
from neocfg.config.planner import CostConstants
from neocfg.config.schema import NeocfgConfig
from neocfg.perf import Perf
from neocfg.planner.strategies import dense_grad_sync, id_weights, sums_by_all_to_all
from neocfg.planner.types import Storage, Topology
from neocfg.sharding import (SCHEMES, OutputKind, PieceShape, Routing, ceil_div, embedding_collectives,
                             gather_collectives)
from neocfg.sharding.collectives import (GATHER_KINDS, ID32_LIMIT, Carries, CollectiveKind, GroupScope, PieceComm,
                                         Traffic, ddp_bucket_bytes, encoding_for, id_collectives)
from neocfg.tiers import TIERS
from neocfg.types import (DataSource, DenseGradSync, DenseOptimizer, DeviceKind, IdDtype, IdsExchange, Interaction,
                          MemoryTier, RoutingEncoding, ShardingType, SparseOptimizer, WeightsDtype)

GIB = 1024**3
GB = 1e9
MS = 1e3
FP32 = 4
# Below this many rows the Zipf normalizer is summed exactly; above, the tail is integrated (error < 1e-6 relative).
_EXACT_HARMONIC_TERMS = 10_000


@functools.lru_cache(maxsize=4096)
def _harmonic_head(n: int, alpha: float) -> float:
    return float(np.sum(np.arange(1, n + 1, dtype=np.float64) ** -alpha))


def generalized_harmonic(n: float, alpha: float) -> float:
    """H(n, alpha) = sum_{k=1..n} k^-alpha (exact head, integral of the tail with the midpoint correction)."""
    n = int(n)
    if n <= 0:
        return 0.0
    head = min(n, _EXACT_HARMONIC_TERMS)
    total = _harmonic_head(head, float(alpha))
    if n > head:
        a, b = head + 0.5, n + 0.5
        total += math.log(b / a) if abs(alpha - 1.0) < 1e-12 else (b ** (1 - alpha) - a ** (1 - alpha)) / (1 - alpha)
    return total


@functools.lru_cache(maxsize=65536)
def zipf_hit_rate(num_rows: int, alpha: float, cache_ratio: float) -> float:
    """Fraction of lookups served by a cache holding the hottest `cache_ratio` of the rows under Zipf(alpha)."""
    cached = max(1, int(num_rows * cache_ratio))
    if cached >= num_rows:
        return 1.0
    return generalized_harmonic(cached, alpha) / generalized_harmonic(num_rows, alpha)


# Rows of a table beyond this are summed in DISTINCT_BINS geometric bins of equal Zipf probability per row (the
# expected distinct count's error < 1e-3 relative).
_DISTINCT_EXACT_ROWS, _DISTINCT_BINS = 4096, 2048


@functools.lru_cache(maxsize=65536)
def distinct_fraction(num_rows: int, alpha: float, ids: float) -> float:
    """The expected share of distinct rows among `ids` independent draws of a table's rows (rank k drawn with
    probability k^-alpha / H(num_rows, alpha)): sum over rows of 1 - exp(-ids x p_k), over ids. Uniform
    (alpha 0): rows x (1 - exp(-ids / rows)) / ids."""
    if ids <= 0 or num_rows <= 0:
        return 1.0
    if alpha <= 0:
        return num_rows * -math.expm1(-ids / num_rows) / ids
    norm = generalized_harmonic(num_rows, alpha)
    head = min(num_rows, _DISTINCT_EXACT_ROWS)
    k = np.arange(1, head + 1, dtype=np.float64)
    total = float(np.sum(-np.expm1(-ids * k ** -alpha / norm)))
    if num_rows > head:   # the tail: bins of rows [a, b), each at its midpoint's probability
        edges = np.unique(np.geomspace(head + 1, num_rows + 1, _DISTINCT_BINS).astype(np.int64))
        mid = (edges[:-1] + edges[1:] - 1) / 2.0
        total += float(np.sum((edges[1:] - edges[:-1]) * -np.expm1(-ids * mid ** -alpha / norm)))
    return min(1.0, total / ids)


def all_reduce_latency_us(cfg: NeocfgConfig) -> float:
    """The data-parallel gradient all-reduce's fixed time per step: the preset's measurement, else one collective's
    (NCCL's small-message all-reduce is no slower than its all-to-all within a node)."""
    hw = cfg.hardware
    return hw.collective_latency_us if hw.all_reduce_latency_us is None else hw.all_reduce_latency_us


def reduce_scatter_latency_us(cfg: NeocfgConfig) -> float:
    """One reduce-scatter or all-gather of the embedding exchange: the preset's measurement, else one collective's."""
    hw = cfg.hardware
    return hw.collective_latency_us if hw.reduce_scatter_latency_us is None else hw.reduce_scatter_latency_us


def _copy_ms_per_byte(gbs: Optional[float]) -> float:
    """Host work per byte of the embedding exchange at `gbs` (unset: free, as on a GPU)."""
    return MS / (gbs * GB) if gbs else 0.0


def ddp_latency_us(cfg: NeocfgConfig) -> float:
    """One of DDP's bucket all-reduces' fixed time: the preset's measurement, else one collective's."""
    hw = cfg.hardware
    return hw.collective_latency_us if hw.ddp_latency_us is None else hw.ddp_latency_us


def ddp_exposed_ms(buckets: Sequence[int], backward_ms: float, alpha_ms: float, ms_per_byte: float) -> float:
    """DDP's all-reduces not hidden behind the dense backward. Bucket i's gradients are ready once the backward has
    produced them (the gradient bytes come out evenly over backward_ms, in bucket order); the all-reduces run one
    after another on their group, each alpha_ms + its bytes x ms_per_byte; what runs past the backward's end is
    exposed: at least the last bucket's (ready only at the end), more where the earlier ones do not fit under the
    rest of the backward."""
    total = sum(buckets)
    done, ready = 0.0, 0
    for b in buckets:
        ready += b
        done = max(done, backward_ms * ready / total) + alpha_ms + b * ms_per_byte
    return max(done - backward_ms, 0.0)


def routing_us_per_step(cfg: NeocfgConfig) -> float:
    """The id routing's host time per step: the preset's measurement, else its ops' launches."""
    dev = cfg.hardware.device
    if dev.routing_us_per_step is not None:
        return dev.routing_us_per_step
    return cfg.planner.costs.router_kernels_per_step * dev.kernel_overhead_us


def tbe_us_per_group(cfg: NeocfgConfig) -> float:
    """One fused lookup group's fixed host time per step: the preset's measurement, else its kernels' launches."""
    dev = cfg.hardware.device
    if dev.tbe_us_per_group is not None:
        return dev.tbe_us_per_group
    return cfg.planner.costs.tbe_kernels_per_group * dev.kernel_overhead_us


def cache_fraction(cfg: NeocfgConfig) -> float:
    """The fraction of every table's hottest rows a device's processor cache holds (hardware.device.cache_mib): its
    bytes over the device's share of the model's fp32 weights (the model spread evenly over the world), at most 1;
    0 without a cache."""
    dev, tables = cfg.hardware.device, cfg.model.tables
    weights = sum(t.num_embeddings * t.embedding_dim * FP32 for t in tables)
    if dev.cache_mib <= 0 or weights <= 0:
        return 0.0
    return min(1.0, dev.cache_mib * 2**20 * cfg.hardware.num_devices / weights)


def planned_id_dtype(cfg: NeocfgConfig) -> IdDtype:
    """The id dtype the plan's strategies will choose (neocfg.planner.strategies.id_dtype), before placement: int32
    when every table's rows fit and so do the bag codes of every table on one rank (tables x world x batch)."""
    largest = max([t.num_embeddings for t in cfg.model.tables]
                  + [len(cfg.model.tables) * cfg.hardware.num_devices * cfg.train.batch_size])
    return IdDtype.int32 if largest < ID32_LIMIT else IdDtype.int64


def step_id_collectives(cfg: NeocfgConfig) -> int:
    """Id collectives in a step as cfg asks for them (neocfg.sharding.collectives.id_collectives): ids exchanged
    ahead where train.ids_exchange=prefetch can run (CPU ranks, the synthetic source's prefetch thread); auto is
    priced as in the step (whether it prefetches depends on the placement's row-sharded tables)."""
    tc = cfg.train
    ahead = (tc.ids_exchange is IdsExchange.prefetch and cfg.hardware.device.kind is DeviceKind.cpu
             and cfg.dsi.source is DataSource.synthetic)
    return id_collectives(tc.pipeline and not ahead, ahead, weighted=id_weights(cfg))


def step_ids_overlapped(cfg: NeocfgConfig) -> bool:
    """Whether the ids' payload travels behind the compute as cfg asks for it: pipelined, or exchanged ahead
    (step_id_collectives' rule)."""
    return cfg.train.pipeline or step_id_collectives(cfg) == 0


def planned_dense_sync(cfg: NeocfgConfig) -> DenseGradSync:
    """How the dense gradients will be synced (StepStrategies.dense_grad_sync, by the strategies' rule), priced
    before placement as if the plan has an all-to-all output: exchange = they ride in its backward all-to-all."""
    params = dense_flops_and_params(cfg.model)[1]
    return dense_grad_sync(cfg.train.dense_grad_sync, params, cfg.hardware.num_devices, all_to_all=True)


def rider_bytes(cfg: NeocfgConfig, sync: DenseGradSync) -> int:
    """The dense gradients riding in the backward all-to-all per device under this sync: the world's fp32 gradients
    when they are folded into it (exchange), none under DDP."""
    if sync is not DenseGradSync.exchange:
        return 0
    return cfg.hardware.num_devices * dense_flops_and_params(cfg.model)[1] * FP32


# Bytes of one processor cache line (x86-64 and the Arm server cores alike).
CACHE_LINE_BYTES = 64

# The batch size in items (ids or bags) at which hardware.host.synthetic_ns_per_id / _per_bag are the rates: the
# generator's block of ids (neocfg.data.synthetic.ID_BLOCK).
SYNTHETIC_REF_ITEMS = 2**16


def row_lines(row_bytes: float) -> float:
    """The processor cache lines one row's first fetch reads (at least one, however narrow the row): a far row costs
    hardware.device.tbe_ns_per_far_line per line (priced per row, whatever its width, uniform ids over wide rows
    read 0.7-0.8 of their measured lookups; bench/calibrate_step.py)."""
    return max(1.0, row_bytes / CACHE_LINE_BYTES)


def scaled_items(count: float, exponent: float) -> float:
    """count items priced as count ** exponent, equal to count at SYNTHETIC_REF_ITEMS (the rates' reference)."""
    if count <= 0 or exponent == 1.0:
        return count
    return count * (count / SYNTHETIC_REF_ITEMS) ** (exponent - 1)


def data_ms(cfg: NeocfgConfig) -> float:
    """Per step on every device: generating the rank's synthetic batch where it competes with the rank (CPU
    devices: the ranks are the host's cores): per batch, per sample, per id and per bag (a sample's ids of one
    table); 0 where the host has cores of its own or nothing is measured."""
    hw, model = cfg.hardware, cfg.model
    if (hw.device.kind is not DeviceKind.cpu or cfg.dsi.source is not DataSource.synthetic
            or hw.host.synthetic_us_per_sample is None):
        return 0.0
    h, b = hw.host, cfg.train.batch_size
    ids, bags = b * sum(t.pooling_factor for t in model.tables), b * len(model.tables)
    items_us = (scaled_items(ids, h.synthetic_exponent) * h.synthetic_ns_per_id
                + scaled_items(bags, h.synthetic_exponent) * h.synthetic_ns_per_bag) / 1e3
    return (h.synthetic_us_per_batch + b * h.synthetic_us_per_sample + items_us) / 1e3


@dataclass(frozen=True)
class CostModel:
    topo: Topology
    batch_size: int
    consts: CostConstants
    hbm_bandwidth_gbs: float
    pcie_bandwidth_gbs: float
    ddr_bandwidth_gbs: float  # the device's share of its host's DDR bandwidth (the node's devices read it at once)
    intra_gbs: float
    inter_gbs: float
    peak_tflops: float
    cache_ratio: float
    a2a_fwd_bytes: int
    a2a_bwd_bytes: int
    sparse_optimizer: SparseOptimizer
    hbm_capacity: int         # usable bytes of device memory per device for embeddings
    host_capacity: int        # usable bytes of host DDR per device (the node's DDR shared by its devices)
    collective_latency_ms: float = 0.0   # alpha: fixed time of one collective
    reduce_scatter_latency_ms: float = 0.0   # ... of one of the exchange's reduce-scatters or all-gathers
    all_reduce_latency_ms: float = 0.0   # ... of the data-parallel gradient all-reduce
    kernel_overhead_ms: float = 0.0      # fixed host-side time of one kernel (op)
    routing_ms_per_step: float = 0.0     # host time of the id routing per step (IdRouter: constant ops)
    routing_ms_per_id: float = 0.0       # ... and per id received
    routing_ms_per_row_id: float = 0.0   # ... and more per id of a row-sharded piece (bucketized by row range)
    tbe_ms_per_group: float = 0.0        # fixed host time of one fused lookup group (TBE) call, forward + backward
    tbe_ms_per_bag: float = 0.0          # ... per bag it walks (one sample's ids of one table), forward + backward
    tbe_ms_per_bag_column: float = 0.0   # ... per column of each bag (its pooled value and that value's gradient)
    tbe_ms_per_row: float = 0.0          # ... per distinct row its ids address (fetched and updated once)
    tbe_ms_per_far_line: float = 0.0     # ... more per cache line of such a row, beyond table_reach_bytes
    table_reach_bytes: float = 0.0
    exchange_copy_ms_per_byte: float = 0.0  # host copies per byte of the embedding exchange (ids, outputs)
    gather_copy_ms_per_byte: float = 0.0    # ... of its reduce-scatters and all-gathers (the sums included)
    sums_copy_ms_per_byte: float = 0.0      # ... of the row-wise partial sums' all-to-all (the sum included)
    exchange_ms_per_bag: float = 0.0     # ... and per bag of the outputs, forward + backward (each segment apart)
    stream_ms_per_byte: float = 0.0      # dense passes over device memory (data-parallel replicas' update)
    # The processor cache of a CPU rank (hardware.device.cache_mib): the fraction of every table's hottest rows it
    # holds (cache_fraction) and the rate of the lookups it serves; 0: none (GPUs).
    cache_fraction: float = 0.0
    cache_ms_per_byte: float = 0.0
    # Each rank's usable bytes where devices differ (a TorchRec Topology's devices); () = the capacities above on
    # every rank. The heuristics place against the smallest (`capacity`), the exact ILP and the checks per rank.
    rank_capacity: tuple[Storage, ...] = ()
    id_bytes: int = 8                    # one id, length or bag code on the wire (the plan's id dtype)
    id_collectives: int = 2              # id collectives in a step (the counts and the payload, or fewer)
    id_weights: bool = False             # per-id weights travel too: a float32 payload the ids' size
    # The ids' payload travels behind the step's compute (pipelined: sent a step ahead on a group of its own, or
    # exchanged in the prefetch thread): its bytes are not in the step, only the wait at its end (its latency)
    ids_overlapped: bool = False
    rider_bytes: int = 0                 # dense gradients riding in the backward all-to-all, per device (world x)
    ddp_wait_ms: float = 0.0             # the exchange's backward wait behind DDP's first bucket (ddp_wait_step_ms)
    # Share of the outputs' all-to-all (latency + wire) the bottom MLP's compute can hide under output_overlap
    output_overlap_efficiency: float = 1.0
    # The plan's routing encoding where it is known (a placed plan's StepStrategies.routing_encoding); None: before
    # placement, each row range's own rule (encoding_for its table's ranges and ids)
    routing_encoding: Optional[RoutingEncoding] = None
    # The row-wise partial sums travel by all-to-all, summed on arrival (StepStrategies.sums_by_all_to_all)
    sums_by_all_to_all: bool = False

    @staticmethod
    def from_config(cfg: NeocfgConfig) -> "CostModel":
        hw, pl = cfg.hardware, cfg.planner
        c = pl.costs
        topo = Topology(hw.nodes, hw.devices_per_node)
        dense = dense_cost(cfg)
        hbm = int(hw.device.hbm_gib * GIB * (1 - c.hbm_reserve_fraction)) - dense.resident_bytes
        host = int(hw.host.ddr_gib * GIB * (1 - c.host_reserve_fraction) / hw.devices_per_node)
        return CostModel(
            topo=topo, batch_size=cfg.train.batch_size, consts=c, hbm_bandwidth_gbs=hw.device.hbm_bandwidth_gbs,
            pcie_bandwidth_gbs=hw.host.pcie_bandwidth_gbs,
            ddr_bandwidth_gbs=hw.host.ddr_bandwidth_gbs / hw.devices_per_node, intra_gbs=hw.intra_node_bandwidth_gbs,
            inter_gbs=hw.inter_node_bandwidth_gbs,
            peak_tflops=hw.device.peak_tflops_at(cfg.train.dense_precision), cache_ratio=pl.cache_ratio,
            a2a_fwd_bytes=pl.a2a_fwd_dtype.bytes, a2a_bwd_bytes=pl.a2a_bwd_dtype.bytes,
            sparse_optimizer=cfg.train.sparse_optimizer, hbm_capacity=max(hbm, 0), host_capacity=host,
            collective_latency_ms=hw.collective_latency_us / 1e3,
            reduce_scatter_latency_ms=reduce_scatter_latency_us(cfg) / 1e3,
            all_reduce_latency_ms=all_reduce_latency_us(cfg) / 1e3,
            kernel_overhead_ms=hw.device.kernel_overhead_us / 1e3,
            routing_ms_per_step=routing_us_per_step(cfg) / 1e3, routing_ms_per_id=hw.device.routing_ns_per_id / 1e6,
            routing_ms_per_row_id=hw.device.routing_ns_per_row_id / 1e6,
            tbe_ms_per_group=tbe_us_per_group(cfg) / 1e3, tbe_ms_per_bag=hw.device.tbe_ns_per_bag / 1e6,
            tbe_ms_per_bag_column=hw.device.tbe_ns_per_bag_column / 1e6, tbe_ms_per_row=hw.device.tbe_ns_per_row / 1e6,
            tbe_ms_per_far_line=hw.device.tbe_ns_per_far_line / 1e6, table_reach_bytes=hw.device.table_reach_mib * 2**20,
            exchange_copy_ms_per_byte=_copy_ms_per_byte(hw.device.exchange_copy_gbs),
            gather_copy_ms_per_byte=_copy_ms_per_byte(hw.device.gather_copy_gbs or hw.device.exchange_copy_gbs),
            sums_copy_ms_per_byte=_copy_ms_per_byte(hw.device.sums_copy_gbs or hw.device.exchange_copy_gbs),
            exchange_ms_per_bag=hw.device.exchange_ns_per_bag / 1e6,
            stream_ms_per_byte=MS / ((hw.device.stream_bandwidth_gbs or hw.device.hbm_bandwidth_gbs) * GB),
            cache_fraction=cache_fraction(cfg),
            cache_ms_per_byte=(MS / (hw.device.cache_bandwidth_gbs * GB * c.hbm_efficiency)
                               if hw.device.cache_bandwidth_gbs else 0.0),
            id_bytes=planned_id_dtype(cfg).bytes, id_collectives=step_id_collectives(cfg), id_weights=id_weights(cfg),
            ids_overlapped=step_ids_overlapped(cfg),
            rider_bytes=rider_bytes(cfg, planned_dense_sync(cfg)),
            ddp_wait_ms=(hw.ddp_exchange_wait_us or 0.0) / 1e3,
            output_overlap_efficiency=hw.output_overlap_efficiency,
            sums_by_all_to_all=sums_by_all_to_all(cfg.train.partial_sums, hw.device.kind is DeviceKind.cpu))

    @property
    def exposed_id_collectives(self) -> int:
        """The id collectives whose latency is in the step: none where the ids travel behind the compute (the
        pipelined payload is waited for a step after it was sent; ids exchanged ahead are the prefetch thread's)."""
        return 0 if self.ids_overlapped else self.id_collectives

    @property
    def capacity(self) -> Storage:
        """What every device has: the smallest rank's capacity where devices differ."""
        if self.rank_capacity:
            return Storage(min(c.hbm for c in self.rank_capacity), min(c.host for c in self.rank_capacity))
        return Storage(self.hbm_capacity, self.host_capacity)

    @property
    def most_capacity(self) -> Storage:
        """The largest rank's capacity (memory rows of relaxations, which must not cut off any plan)."""
        if self.rank_capacity:
            return Storage(max(c.hbm for c in self.rank_capacity), max(c.host for c in self.rank_capacity))
        return self.capacity

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.topo.world

    # ---- communication: milliseconds per byte -------------------------------------------------------------
    def a2a_ms_per_byte(self) -> float:
        """A device exchanging bytes evenly with every device of the world (itself free)."""
        w, p = self.topo.world, self.topo.devices_per_node
        intra, inter = (p - 1) / w, (w - p) / w
        return (intra / (self.intra_gbs * GB) + inter / (self.inter_gbs * GB)) * MS / self.consts.comm_efficiency

    def cross_node_ms_per_byte(self) -> float:
        """An all-to-all among the ranks with the same local index, one per node: all but its own share crosses."""
        n = self.topo.nodes
        return (n - 1) / n / (self.inter_gbs * GB) * MS / self.consts.comm_efficiency

    def reduce_scatter_ms_per_byte(self, within_node: bool = False) -> float:
        """Hierarchical reduce-scatter (or all-gather) of a buffer of that many bytes present on every device."""
        p, n = self.topo.devices_per_node, self.topo.nodes
        t = (p - 1) / p / (self.intra_gbs * GB)
        if not within_node:
            t += (n - 1) / n / p / (self.inter_gbs * GB)
        return t * MS / self.consts.comm_efficiency

    # ---- fixed per-step costs of the embedding part (the same on every device: all take part) ---------------
    def collectives_latency_ms(self, shardings: Iterable[ShardingType]) -> float:
        """The embedding collectives' fixed time per step: collective_latency_ms for each the plan's kinds issue
        (`embedding_collectives`), but reduce_scatter_latency_ms for its reduce-scatters and all-gathers
        (`gather_collectives`) and all_reduce_latency_ms for the data-parallel tables' all-reduce."""
        shardings = set(shardings)
        replicated = {s for s in shardings if self.kind_of(s) is OutputKind.replicated}
        world, per = self.topo.world, self.topo.devices_per_node
        gathers = gather_collectives(shardings - replicated, world, per, self.sums_by_all_to_all)
        alpha = (embedding_collectives(shardings - replicated, self.exposed_id_collectives, world, per) - gathers) \
            * self.collective_latency_ms + gathers * self.reduce_scatter_latency_ms
        return alpha + (self.all_reduce_latency_ms if replicated else 0.0) + self.rider_ms(shardings)

    def rider_ms(self, shardings: Iterable[ShardingType]) -> float:
        """The dense gradients riding in the backward all-to-all (world x their fp32 bytes each way, with the
        exchange's copies) when the kinds include it; paid once, as the kind's collectives are."""
        if not self.rider_bytes or not any(self.kind_of(s) is OutputKind.all_to_all for s in shardings):
            return 0.0
        return self.rider_bytes * (self.a2a_ms_per_byte() + self.exchange_copy_ms_per_byte)

    def ddp_wait_step_ms(self, shardings: Iterable[ShardingType], sync: DenseGradSync, overlap: bool) -> float:
        """The output exchange's backward wait behind DDP's first bucket all-reduce (hardware.ddp_exchange_wait_us),
        once per step: where DDP syncs the dense gradients and outputs are exchanged and waited for (not sent behind
        the bottom MLP: there the wait did not show). The solvers leave it out (whether a plan pays it turns on whether
        it overlaps, under output_overlap=auto on CPU on whether the bottom MLP covers it), so their bound stays a
        bound; a plan's objective and estimate pay it (neocfg.planner.assemble)."""
        exchanged = any(self.kind_of(s) is not OutputKind.replicated for s in shardings)
        return self.ddp_wait_ms if sync is DenseGradSync.ddp and exchanged and not overlap else 0.0

    def embedding_overhead_ms(self, shardings: Iterable[ShardingType], groups: int = 0) -> Perf:
        """Fixed per-step costs of the embedding part on one device, for a plan with these sharding types, the device
        holding `groups` fused lookup groups (one TBE per weights precision x memory tier). Communication: the
        collectives' latency, the id routing (a constant number of ops per step: the IdRouter) and the output
        exchange's kernels; compute: each TBE call's fixed time (tbe_ms_per_group). No term grows with the number of table pieces."""
        c = self.consts
        shardings = set(shardings)
        rider = self.rider_ms(shardings)
        alpha = self.collectives_latency_ms(shardings) - rider
        exchange = c.embedding_step_kernels * self.kernel_overhead_ms + self.routing_ms_per_step
        tbe = groups * self.tbe_ms_per_group
        # ids and outputs travel forward, gradients backward: 2 of the 3 exchanges (and the routing) run forward
        return Perf(fwd_compute=tbe / 2, bwd_compute=tbe / 2, fwd_comm=(alpha + exchange) * 2 / 3,
                    bwd_comm=(alpha + exchange) / 3 + rider)

    # ---- memory ------------------------------------------------------------------------------------------
    def optimizer_state_bytes(self, rows: int, cols: int) -> int:
        return {SparseOptimizer.exact_rowwise_adagrad: rows * FP32, SparseOptimizer.exact_adagrad: rows * cols * FP32,
                SparseOptimizer.exact_sgd: 0}[self.sparse_optimizer]

    def storage(self, shape: PieceShape, tier: MemoryTier, dtype: WeightsDtype, sharding: ShardingType) -> Storage:
        weights = shape.rows * shape.cols * dtype.bytes
        state = self.optimizer_state_bytes(shape.rows, shape.cols)
        # ids received + pooled outputs produced + their gradients received, fp32 on the device.
        buffers = int(shape.lookup_rows * self.id_bytes + 2 * shape.output_samples * shape.cols * FP32)
        buffers += SCHEMES[sharding].gradient_bytes(shape)
        where = TIERS[tier]
        if where.on_device:
            return Storage(weights + state + buffers, 0)
        cache = 0
        if where.hbm_cache:
            cached = int(shape.rows * self.cache_ratio)
            cache = cached * shape.cols * dtype.bytes + cached * self.consts.cache_metadata_bytes_per_row
        return Storage(cache + buffers, weights + state)

    # ---- compute -----------------------------------------------------------------------------------------
    def lookup_ms_per_byte(self, table: TableConfig, tier: MemoryTier, rows: int) -> float:
        hbm = 1.0 / (self.hbm_bandwidth_gbs * GB * self.consts.hbm_efficiency)
        pcie = self.host_read_s_per_byte()
        where = TIERS[tier]
        if where.on_device:
            if self.cache_fraction <= 0:
                return hbm * MS
            # the table's hottest cache_fraction of rows come from the processor cache (hot rows are spread over
            # its row shards alike: the same hit rate on every piece)
            h = zipf_hit_rate(table.num_embeddings, table.alpha, self.cache_fraction)
            return h * self.cache_ms_per_byte + (1 - h) * hbm * MS
        if where.hbm_cache:
            h = zipf_hit_rate(rows, table.alpha, self.cache_ratio)
            return (h * hbm + (1 - h) * pcie) * MS
        return pcie * MS

    def host_read_s_per_byte(self) -> float:
        """Seconds per byte of rows gathered from host DDR (UVM cache misses, host-resident tables): the slower of the
        PCIe link (scattered reads at pcie_efficiency) and the device's share of the host's DDR bandwidth (random row
        gathers at hbm_efficiency, the same access pattern as a TBE on device memory)."""
        pcie = 1.0 / (self.pcie_bandwidth_gbs * GB * self.consts.pcie_efficiency)
        ddr = 1.0 / (self.ddr_bandwidth_gbs * GB * self.consts.hbm_efficiency)
        return max(pcie, ddr)

    def compute(self, table: TableConfig, shape: PieceShape, tier: MemoryTier, dtype: WeightsDtype) -> Perf:
        """The piece's lookups: its rows' bytes at the tier's rate, shard_overhead_us, and the TBE's walk
        (`tbe_walk_ms`); backward bwd_compute_multiplier x forward."""
        fwd = shape.lookup_rows * shape.cols * dtype.bytes * self.lookup_ms_per_byte(table, tier, shape.rows)
        fwd += self.consts.shard_overhead_us / 1e3
        fwd += self.tbe_walk_ms(table, shape, dtype) / (1 + self.consts.bwd_compute_multiplier)
        return Perf(fwd_compute=fwd, bwd_compute=fwd * self.consts.bwd_compute_multiplier)

    def tbe_walk_ms(self, table: TableConfig, shape: PieceShape, dtype: WeightsDtype = WeightsDtype.fp32) -> float:
        """The fused lookup's work beyond the rows' bytes, forward + backward: tbe_ms_per_bag per bag (output
        sample) the piece pools and tbe_ms_per_bag_column per column of each (its pooled value written forward, its
        gradient read back backward), tbe_ms_per_row per distinct row its ids address (`distinct_rows`), and
        tbe_ms_per_far_line more per cache line of such a row (`row_lines`) as the piece's rows span beyond
        table_reach_bytes (`far_share`)."""
        bags = shape.output_samples * (self.tbe_ms_per_bag + self.tbe_ms_per_bag_column * shape.cols)
        per_row = self.tbe_ms_per_row + self.tbe_ms_per_far_line * self.far_share(shape, dtype) * row_lines(
            shape.cols * dtype.bytes)
        return bags + (self.distinct_rows(table, shape) * per_row if per_row else 0.0)

    def far_share(self, shape: PieceShape, dtype: WeightsDtype) -> float:
        """How far a piece's rows span beyond the device's table reach: 1 - table_reach_bytes / its rows' bytes, at
        least 0 (0 where the reach is unset: no far rows)."""
        span = shape.rows * shape.cols * dtype.bytes
        if self.table_reach_bytes <= 0 or span <= self.table_reach_bytes:
            return 0.0
        return 1 - self.table_reach_bytes / span

    @staticmethod
    def distinct_rows(table: TableConfig, shape: PieceShape) -> float:
        """The distinct rows among the piece's ids in a step: its ids x the distinct share of the ids the whole
        table receives (the piece's ids over its share of the rows; hot rows spread over row shards alike)."""
        if shape.lookup_rows <= 0 or shape.rows <= 0:
            return 0.0
        drawn = shape.lookup_rows * table.num_embeddings / shape.rows
        return shape.lookup_rows * distinct_fraction(table.num_embeddings, table.alpha, drawn)

    def routed_ms(self, sharding: ShardingType, shape: PieceShape) -> float:
        """The router's passes over the ids the piece receives (none for a replica, which looks up its own
        samples; more per id where they are bucketized by row range): forward, on whichever thread exchanges the ids
        (the step's, or the prefetch thread's)."""
        routing = SCHEMES[sharding].routing
        if routing is Routing.local:
            return 0.0
        per_id = self.routing_ms_per_id + (self.routing_ms_per_row_id if routing is Routing.by_row else 0.0)
        return shape.lookup_rows * per_id

    def comm(self, table: TableConfig, sharding: ShardingType, shape: PieceShape) -> Perf:
        """Ids in, outputs out, gradients back: the collectives the piece adds to the step (its Scheme's
        piece_comms, the list the runtime issues), each priced at its bytes on the holder's link, plus the router's
        passes over the ids the piece receives (none for a replica, which looks up its own samples) and the
        exchange's host work per bag of its outputs (`bag_copies_ms`)."""
        perf = Perf(fwd_comm=self.routed_ms(sharding, shape))
        records = self.piece_comms(table, sharding, shape)
        for pc in records:
            perf = perf + self.price(pc)
        return perf + self.bag_copies_ms(records, shape)

    def bag_copies_ms(self, records: tuple[PieceComm, ...], shape: PieceShape) -> Perf:
        """The exchange's host work per bag whose pooled value the piece's outputs carry, beyond their bytes
        (exchange_ms_per_bag: half forward where the outputs travel, half backward where their gradients do)."""
        if self.exchange_ms_per_bag <= 0:
            return Perf()
        half = shape.output_samples * self.exchange_ms_per_bag / 2
        carried = {pc.carries for pc in records}
        return Perf(fwd_comm=half if carried & {Carries.outputs, Carries.partial_sums} else 0.0,
                    bwd_comm=half if Carries.output_grads in carried else 0.0)

    def ids_ms(self, table: TableConfig, sharding: ShardingType, shape: PieceShape) -> float:
        """The part of comm() that is the piece's ids on the wire (the id payload's records)."""
        return sum(self.price(pc).total for pc in self.piece_comms(table, sharding, shape) if pc.carries is Carries.ids)

    def piece_comms(self, table: TableConfig, sharding: ShardingType, shape: PieceShape) -> tuple[PieceComm, ...]:
        """The piece's records (neocfg.sharding.collectives): a row range receives its share of the table's ids,
        in the encoding the strategies' rule picks for its ranges (neocfg.planner.strategies.routing_encoding)."""
        pooling = table.pooling_factor
        share = shape.lookup_rows / (self.global_batch * pooling) if pooling else 1.0
        encoding = self.routing_encoding
        if encoding is None:
            encoding = encoding_for(1 / share, pooling) if share > 0 else RoutingEncoding.lengths
        traffic = Traffic(batch_size=self.batch_size, world=self.topo.world,
                          devices_per_node=self.topo.devices_per_node, id_bytes=self.id_bytes,
                          fwd_bytes=self.a2a_fwd_bytes, bwd_bytes=self.a2a_bwd_bytes, encoding=encoding,
                          sums_by_all_to_all=self.sums_by_all_to_all)
        return SCHEMES[sharding].piece_comms(traffic, shape, pooling, self.kind_of(sharding), share=share)

    def kind_of(self, sharding: ShardingType) -> OutputKind:
        """The output kind the type's placements take on this topology (Scheme.planned_kind)."""
        return SCHEMES[sharding].planned_kind(self.topo.world, self.topo.devices_per_node)

    def price(self, pc: PieceComm) -> Perf:
        """One record at the holder's bytes (the larger direction) over its collective's rate, plus the host copies
        of the embedding exchange (not of a replica's all-reduce, done in place); forward for ids and outputs. The
        ids' payload costs the step nothing where it travels behind the compute (ids_overlapped)."""
        if pc.carries is Carries.ids and self.ids_overlapped:
            return Perf()
        copy = (0.0 if pc.carries is Carries.replica_grads
                else self.gather_copy_ms_per_byte if pc.kind in GATHER_KINDS
                else self.sums_copy_ms_per_byte if pc.carries is Carries.partial_sums
                else self.exchange_copy_ms_per_byte)
        ms = pc.held_bytes * (self.rate_ms_per_byte(pc) + copy)
        if pc.carries is Carries.ids and self.id_weights:   # the weights' payload: the ids' elements as float32
            ms *= 1 + FP32 / self.id_bytes
        forward = pc.carries in (Carries.ids, Carries.outputs, Carries.partial_sums)
        return Perf(fwd_comm=ms) if forward else Perf(bwd_comm=ms)

    def output_wire_ms(self, table: TableConfig, sharding: ShardingType, shape: PieceShape) -> tuple[float, float]:
        """The piece's part of the pooled outputs' world all-to-all (forward) and of its gradients' (backward): its
        bytes at the link rate, without the exchange's host copies (what can travel behind the bottom MLP under
        StepStrategies.output_overlap)."""
        wire = [0.0, 0.0]
        for pc in self.piece_comms(table, sharding, shape):
            if (pc.kind, pc.group) != (CollectiveKind.all_to_all, GroupScope.world) \
                    or pc.carries not in (Carries.outputs, Carries.output_grads):
                continue
            wire[pc.carries is Carries.output_grads] += pc.held_bytes * self.rate_ms_per_byte(pc)
        return wire[0], wire[1]

    def rate_ms_per_byte(self, pc: PieceComm) -> float:
        """The record's collective's link rate (without the exchange's host copies)."""
        return {(CollectiveKind.all_to_all, GroupScope.world): self.a2a_ms_per_byte,
                (CollectiveKind.all_to_all, GroupScope.cross_node): self.cross_node_ms_per_byte,
                (CollectiveKind.reduce_scatter, GroupScope.world): self.reduce_scatter_ms_per_byte,
                (CollectiveKind.all_gather, GroupScope.world): self.reduce_scatter_ms_per_byte,
                (CollectiveKind.reduce_scatter, GroupScope.intra_node): lambda: self.reduce_scatter_ms_per_byte(True),
                (CollectiveKind.all_gather, GroupScope.intra_node): lambda: self.reduce_scatter_ms_per_byte(True),
                (CollectiveKind.all_reduce, GroupScope.world): lambda: 2 * self.reduce_scatter_ms_per_byte(),
                }[pc.kind, pc.group]()

    def replica_update_ms(self, sharding: ShardingType, shape: PieceShape) -> Perf:
        """A data-parallel replica's passes over its whole fp32 table per step (dense gradient, its all-reduce in
        place, the optimizer's update): planner.costs.replica_update_passes at the streaming bandwidth; backward."""
        grad = SCHEMES[sharding].gradient_bytes(shape)
        return Perf(bwd_compute=grad * self.consts.replica_update_passes * self.stream_ms_per_byte)

    # ---- pieces ------------------------------------------------------------------------------------------
    def shape(self, table: TableConfig, sharding: ShardingType, num_pieces: int) -> PieceShape:
        return SCHEMES[sharding].piece_shape(self, table, num_pieces)

    def piece(self, table: TableConfig, sharding: ShardingType, tier: MemoryTier, dtype: WeightsDtype,
              num_pieces: int) -> tuple[Perf, Storage]:
        shape = self.shape(table, sharding, num_pieces)
        perf = (self.compute(table, shape, tier, dtype) + self.replica_update_ms(sharding, shape)
                + self.comm(table, sharding, shape))
        return perf, self.storage(shape, tier, dtype, sharding)


# ---- the dense part ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DenseCost:
    flops_per_sample: float   # forward
    parameters: int
    perf: Perf                # per device per step
    resident_bytes: int       # parameters + optimizer state on every device
    # The bottom MLP's share of perf's compute (its layers' FLOPs, activation passes and kernels, priced as the whole
    # dense part's): what the pooled outputs' all-to-all can travel behind (StepStrategies.output_overlap).
    bottom: Perf = Perf()


def _mlp(widths: list[int]) -> tuple[float, int]:
    flops = sum(2 * a * b for a, b in zip(widths, widths[1:]))
    params = sum(a * b + b for a, b in zip(widths, widths[1:]))
    return flops, params


def dense_flops_and_params(model: ModelConfig) -> tuple[float, int]:
    bottom_f, bottom_p = _mlp([model.num_dense_features] + model.bottom_layers)
    features = len(model.tables) + 1
    if model.interaction is Interaction.dot:
        d = model.tables[0].embedding_dim
        inter_f, inter_p = features * features * d, 0
        top_in = d + features * (features - 1) // 2
    else:
        x = sum(model.embedding_dims) + model.bottom_layers[-1]
        r = model.dcn_low_rank_dim
        inter_f = model.dcn_num_layers * (4 * x * r + 3 * x)
        inter_p = model.dcn_num_layers * (2 * x * r + x)
        top_in = x
    top_f, top_p = _mlp([top_in] + list(model.top_mlp))
    return bottom_f + inter_f + top_f, bottom_p + inter_p + top_p


def dense_activations(model: ModelConfig) -> int:
    """fp32 activations per sample the dense part writes and reads back: every MLP layer's input and output, the
    interaction's input (the pooled embeddings and the bottom MLP's output) and output (dot: the F x F products too)."""
    features = len(model.tables) + 1
    x = sum(model.embedding_dims) + model.bottom_layers[-1]
    if model.interaction is Interaction.dot:
        d = model.tables[0].embedding_dim
        inter = features * features + d + features * (features - 1) // 2
    else:
        inter = x * (1 + model.dcn_num_layers)   # each cross layer's output, the last one the top MLP's input
    return (model.num_dense_features + sum(model.bottom_layers) + x + inter + sum(model.top_mlp))


def dense_layers(model: ModelConfig) -> int:
    """Linear layers of the dense part (bottom and top MLPs; DCN: two low-rank matmuls per cross layer)."""
    inter = 0 if model.interaction is Interaction.dot else 2 * model.dcn_num_layers
    return len(model.bottom_layers) + inter + len(model.top_mlp)


# Optimizer state per dense parameter, in fp32 words.
_DENSE_STATE_WORDS = {DenseOptimizer.sgd: 0, DenseOptimizer.adagrad: 1, DenseOptimizer.adam: 2}
# Training FLOPs as a multiple of forward FLOPs (backward computes gradients of inputs and of weights).
TRAIN_FLOPS_PER_FWD = 3


def ddp_allreduce_ms(cfg: NeocfgConfig, backward_ms: float, latency_us: float | None = None) -> float:
    """DDP's all-reduce of the dense gradients as exposed after a dense backward of backward_ms (ddp_exposed_ms): the
    step's list of buckets (neocfg.sharding.collectives.ddp_bucket_bytes), each a ring all-reduce (twice its bytes
    over the hierarchical reduce-scatter's rate) at ddp_latency_us (or `latency_us`)."""
    hw, c = cfg.hardware, cfg.planner.costs
    p, n = hw.devices_per_node, hw.nodes
    per_byte = ((p - 1) / p / (hw.intra_node_bandwidth_gbs * GB)
                + (n - 1) / n / p / (hw.inter_node_bandwidth_gbs * GB)) * MS / c.comm_efficiency
    buckets = ddp_bucket_bytes(dense_flops_and_params(cfg.model)[1] * FP32, c.ddp_bucket_mib)
    alpha = ddp_latency_us(cfg) if latency_us is None else latency_us
    return ddp_exposed_ms(buckets, backward_ms, alpha / 1e3, 2 * per_byte)


def dense_cost(cfg: NeocfgConfig, sync: DenseGradSync | None = None) -> DenseCost:
    """The dense part per device and step: FLOPs at peak x MFU, dense_activation_passes over its activations at the
    streaming bandwidth, its kernels' fixed costs, and DDP's all-reduce unless `sync` folds the dense gradients into
    the embeddings' backward all-to-all (exchange: their bytes ride in that collective, CostModel.rider_ms, no
    collective of their own). sync None: as the planner prices it before placement (`planned_dense_sync`)."""
    if sync is None:
        sync = planned_dense_sync(cfg)
    c, model = cfg.planner.costs, cfg.model
    flops, params = dense_flops_and_params(model)
    compute = _dense_compute(cfg, flops, dense_activations(model),
                             dense_fixed_ms(cfg, c.dense_kernels_per_layer * dense_layers(model) + c.dense_step_kernels))
    bottom_flops, _ = _mlp([model.num_dense_features] + model.bottom_layers)
    bottom = _dense_compute(cfg, bottom_flops, model.num_dense_features + sum(model.bottom_layers),
                            dense_fixed_ms(cfg, c.dense_kernels_per_layer * len(model.bottom_layers)))
    allreduce = ddp_allreduce_ms(cfg, compute.bwd_compute) if sync is DenseGradSync.ddp else 0.0
    perf = Perf(fwd_compute=compute.fwd_compute, bwd_compute=compute.bwd_compute, bwd_comm=allreduce)
    resident = params * FP32 * (1 + _DENSE_STATE_WORDS[cfg.train.dense_optimizer])
    if cfg.planner.dense_resident_bytes is not None:
        resident = cfg.planner.dense_resident_bytes
    return DenseCost(flops_per_sample=flops, parameters=params, perf=perf, resident_bytes=resident, bottom=bottom)


def dense_fixed_ms(cfg: NeocfgConfig, kernels: float) -> float:
    """The fixed host time of these of the dense part's kernels: each kernel_overhead_us, or, where the device gives
    hardware.device.dense_fixed_us (the whole dense part's, whatever its layers), their share of the dense part's
    kernels of it."""
    dev, c = cfg.hardware.device, cfg.planner.costs
    if dev.dense_fixed_us is None:
        return kernels * dev.kernel_overhead_us / 1e3
    every = c.dense_kernels_per_layer * dense_layers(cfg.model) + c.dense_step_kernels
    return dev.dense_fixed_us / 1e3 * (kernels / every if every > 0 else 1.0)


def _dense_compute(cfg: NeocfgConfig, flops: float, activations: float, fixed: float) -> Perf:
    """Dense layers' compute per device and step: forward FLOPs per sample at peak x MFU (backward
    TRAIN_FLOPS_PER_FWD - 1 times them), dense_activation_passes over their fp32 activations per sample at the
    streaming bandwidth, and their fixed host time (`dense_fixed_ms`, ms); a third of the fixed time and passes run
    forward (see dense_kernels_per_layer: 2 of 6 per layer)."""
    hw, c = cfg.hardware, cfg.planner.costs
    mfu = c.dense_mfu if hw.device.dense_mfu is None else hw.device.dense_mfu
    rate = hw.device.peak_tflops_at(cfg.train.dense_precision) * 1e12 * mfu
    fwd = flops * cfg.train.batch_size / rate * MS
    stream_gbs = hw.device.stream_bandwidth_gbs or hw.device.hbm_bandwidth_gbs
    passes = c.dense_activation_passes * activations * FP32 * cfg.train.batch_size / (stream_gbs * GB) * MS
    return Perf(fwd_compute=fwd + (fixed + passes) / 3,
                bwd_compute=fwd * (TRAIN_FLOPS_PER_FWD - 1) + (fixed + passes) * 2 / 3)
