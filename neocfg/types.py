"""Enumerations shared by the config schema, the planner, the plan file and the runtime.

Member names are the spellings users write in YAML and that appear in plan.json, so they are lower case.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path


class Mode(Enum):
    describe = "describe"
    plan = "plan"
    train = "train"
    gen_data = "gen_data"


class ShardingType(Enum):
    table_wise = "table_wise"
    column_wise = "column_wise"
    row_wise = "row_wise"
    table_row_wise = "table_row_wise"
    table_column_wise = "table_column_wise"
    data_parallel = "data_parallel"


class MemoryTier(Enum):
    hbm = "hbm"
    uvm_caching = "uvm_caching"
    host = "host"


class WeightsDtype(Enum):
    fp32 = "fp32"
    fp16 = "fp16"

    @property
    def bytes(self) -> int:
        return {"fp32": 4, "fp16": 2}[self.value]


class CommDtype(Enum):
    """Precision of the embedding all-to-all payloads (quality-preserving compression, Neo section 5)."""

    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"

    @property
    def bytes(self) -> int:
        return {"fp32": 4, "fp16": 2, "bf16": 2}[self.value]


class PlanExport(Enum):
    """Other systems' plan formats mode=plan can write beside plan.json (planner.export)."""

    torchrec = "torchrec"      # torchrec_plan.json: neocfg.interop.torchrec.load_torchrec_plan -> ShardingPlan


class Interaction(Enum):
    dot = "dot"
    dcn = "dcn"
    auto = "auto"   # dot when every table has the bottom MLP's output dim, else dcn (resolved when loading)


class SparseOptimizer(Enum):
    exact_rowwise_adagrad = "exact_rowwise_adagrad"
    exact_adagrad = "exact_adagrad"
    exact_sgd = "exact_sgd"


class DenseOptimizer(Enum):
    sgd = "sgd"
    adagrad = "adagrad"
    adam = "adam"


class DenseGradSync(Enum):
    """How the dense gradients are averaged over ranks. ddp: DistributedDataParallel's bucketed all-reduce; exchange:
    in the embeddings' backward all-to-all (one collective fewer; each rank sends world x the dense gradients);
    auto: exchange when that is small (neocfg.planner.strategies.DENSE_FOLD_MAX_BYTES) and the plan has an
    all-to-all output, else ddp (resolved by the planner into plan.json's strategies)."""

    auto = "auto"
    ddp = "ddp"
    exchange = "exchange"


class IdsExchange(Enum):
    """Where a CPU rank exchanges each batch's ids (route, all-to-alls, receive). step: in the step (pipelined under
    train.pipeline); prefetch: in the data source's prefetch thread, a batch ahead, on a process group of its own;
    auto: prefetch when some table is row-sharded (neocfg.planner.strategies.ids_exchange), else step. GPU
    ranks, and sources without a prefetch thread (only the synthetic one has it), always exchange in the step."""

    auto = "auto"
    prefetch = "prefetch"
    step = "step"


class OutputOverlap(Enum):
    """Whether the pooled outputs' all-to-all travels while the bottom MLP runs (StepStrategies.output_overlap).
    overlap: it is sent before the bottom MLP and waited for at the interaction, and the gradients' all-to-all is sent
    before the bottom MLP's backward and waited for after it; wait: each is waited for at once; auto: overlap where
    it can run (dense gradients synced by DDP, and some pooled output comes back by all-to-all), resolved by the
    planner into plan.json's strategies (neocfg.planner.strategies.output_overlap)."""

    auto = "auto"
    overlap = "overlap"
    wait = "wait"


class PrefetchPriority(Enum):
    """The scheduling class of the data source's prefetch thread (StepStrategies.prefetch_idle). idle: Linux's
    SCHED_IDLE, so the thread runs when the rank's main thread waits (on a collective, on the next batch) instead of
    taking turns with its compute; normal: the default class; auto: normal for now (the estimate does not price the
    idle thread's runs inside the step's waits; see neocfg.planner.strategies), resolved by the planner into
    plan.json's strategies."""

    auto = "auto"
    normal = "normal"
    idle = "idle"


class PartialSums(Enum):
    """How the row-wise tables' partial pooled sums reach the ranks of their samples
    (StepStrategies.sums_by_all_to_all). reduce_scatter: torch.distributed's reduce-scatter (NCCL's ring,
    hierarchical across nodes); all_to_all: an all-to-all of the same bytes, summed on arrival (gloo's reduce-scatter
    took 1.6-2.5x as long: bench/bench_gloo_collectives.py); auto: all_to_all on CPU devices (gloo), reduce_scatter
    on GPUs, resolved by the planner into plan.json's strategies."""

    auto = "auto"
    reduce_scatter = "reduce_scatter"
    all_to_all = "all_to_all"


class IdDtype(Enum):
    """The integer type the ids, lengths and bag codes travel and are looked up in (StepStrategies.id_dtype)."""

    int32 = "int32"
    int64 = "int64"

    @property
    def bytes(self) -> int:
        return {"int32": 4, "int64": 8}[self.value]


class RoutingEncoding(Enum):
    """How row-sharded tables' ids travel (neocfg.runtime.routing): lengths (TorchRec's: [B] lengths per piece
    beside its ids) or codes (each id with its bag code: costs grow with the ids only)."""

    lengths = "lengths"
    codes = "codes"


# ---- the step's collectives (neocfg.sharding.collectives; Plan.collectives) ----
class CollectiveKind(Enum):
    all_to_all = "all_to_all"
    reduce_scatter = "reduce_scatter"
    all_gather = "all_gather"
    all_reduce = "all_reduce"


class GroupScope(Enum):
    """Which ranks take part in one collective."""

    world = "world"
    intra_node = "intra_node"    # the ranks of one node
    cross_node = "cross_node"    # one rank per node, the same local index


class Carries(Enum):
    """What a collective moves (and so which of the runtime's process groups it runs on)."""

    id_counts = "id_counts"          # per-destination sizes of the id payload (int64)
    ids = "ids"                      # lengths, ids (and bag codes) of the batch, in the plan's id dtype
    id_weights = "id_weights"        # per-id weights (float32) in the id payload's layout, where the data has them
    outputs = "outputs"              # pooled outputs, forward, in a2a_fwd_dtype
    partial_sums = "partial_sums"    # row-wise tables' partial sums, forward, in a2a_fwd_dtype (summed on arrival)
    output_grads = "output_grads"    # their gradients, backward, in a2a_bwd_dtype (and the dense gradients riding)
    replica_grads = "replica_grads"  # the data-parallel replicas' fp32 table gradient
    dense_grads = "dense_grads"      # DDP's all-reduce of the dense gradients (fp32 buckets)


class DensePrecision(Enum):
    """Math of the dense part (MLPs, interaction). tf32: fp32 storage, TF32 tensor-core matmuls on CUDA (plain fp32 on
    a CPU); bf16: autocast to bfloat16."""

    fp32 = "fp32"
    tf32 = "tf32"
    bf16 = "bf16"


class DeviceKind(Enum):
    cpu = "cpu"
    gpu = "gpu"


class Backend(Enum):
    gloo = "gloo"
    nccl = "nccl"


class DataSource(Enum):
    synthetic = "synthetic"
    parquet = "parquet"


class RawFormat(Enum):
    """What mode=gen_data writes the dataset from: generated samples, or files in a public format it converts."""

    none = "none"        # generate synthetic samples (dsi.num_samples, ...)
    criteo = "criteo"    # Criteo's click logs: Kaggle Display Advertising train.txt, 1TB Click Logs day_N[.gz]


class CategoricalEncoding(Enum):
    """How raw categorical values become table rows when mode=gen_data converts a public dataset."""

    hash = "hash"              # the raw id is stored; DPP's hash transform takes it modulo the table's rows
    vocabulary = "vocabulary"  # ids seen at least frequency_threshold times get rows 2, 3, ... in order of first
    #                            appearance, the rest row 1 (TorchRec's sparse_to_contiguous)


class PlannerAlgorithm(Enum):
    ilp = "ilp"
    greedy = "greedy"


class MipSolver(Enum):
    """The MIP solver behind planner.algorithm=ilp (both driven through PuLP models)."""

    cbc = "cbc"       # PuLP's bundled CBC (command line)
    highs = "highs"   # HiGHS through highspy


class OnBadSplit(Enum):
    fail = "fail"
    skip = "skip"


class TransformOp(Enum):
    """A DPP preprocessing step declared per feature column (neocfg/data/transforms.py)."""

    filter = "filter"              # drop rows whose value fails `cmp value` (missing values always fail)
    fill_missing = "fill_missing"  # missing dense value -> value; missing id list -> empty
    clip_min = "clip_min"          # y = max(x, value) (negatives -> 0 with value 0, as DLRM's Criteo preprocessing)
    log = "log"                    # y = ln(max(x + offset, LOG_FLOOR))
    logit = "logit"                # y = ln(p / (1 - p)), p = clip(x, eps, 1 - eps)
    bucketize = "bucketize"        # y = number of boundaries <= x (as a float)
    hash = "hash"                  # id -> id mod num_embeddings of the feature's table
    truncate = "truncate"          # keep the first max_ids ids of each list


class FilterCmp(Enum):
    not_null = "not_null"
    eq = "eq"
    ne = "ne"
    lt = "lt"
    le = "le"
    gt = "gt"
    ge = "ge"


class _BackendKinds(Enum):
    """Where DPP workers run: one member per backend module in neocfg/data/dpp/backends/ (local processes per trainer
    rank, the default; inline in the trainer process, no parallelism; Ray actors under one job-wide master actor; and
    any backend added there as one module). Whether a backend serves the whole job or one rank is its module's
    declaration: neocfg.data.dpp.backends.backend_of(kind).job_wide."""



def _backend_names() -> list[str]:
    """The backend modules, found without importing them."""
    found = Path(__file__).parent / "data" / "dpp" / "backends"
    return sorted(p.stem for p in found.glob("*.py") if not p.stem.startswith("_"))


DppBackendKind = _BackendKinds("DppBackendKind", [(n, n) for n in _backend_names()],  # type: ignore[misc]
                               module=__name__, qualname="DppBackendKind")


class SweepMetric(Enum):
    """Columns of the sweep summary: planner estimates (plan.json) and training measurements (metrics.json)."""

    step_ms = "step_ms"
    samples_per_s = "samples_per_s"
    max_hbm_pct = "max_hbm_pct"
    objective_ms = "objective_ms"
    lower_bound_ms = "lower_bound_ms"
    gap = "gap"
    solver_s = "solver_s"
    dpp_workers = "dpp_workers"
    measured_step_ms = "measured_step_ms"
    measured_samples_per_s = "measured_samples_per_s"
    final_loss = "final_loss"
    eval_auc = "eval_auc"
