"""Schema of the `model` group: the embedding tables and the dense (MLP / interaction) architecture."""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

from neocfg.config import checks
from neocfg.errors import ConfigError
from neocfg.types import Interaction, MemoryTier, ShardingType, WeightsDtype

# Default skew of id accesses when a table does not state one. Source: Criteo categorical features follow a
# power law with exponent about 1 (e.g. "Understanding Training Efficiency of Deep Learning Recommendation
# Models at Scale", Acun et al., HPCA'21, fig. 5); 1.05 keeps the sampler well defined.
DEFAULT_ZIPF_ALPHA = 1.05


@dataclass
class TableConfig:
    name: str = MISSING
    num_embeddings: int = MISSING
    embedding_dim: int = MISSING
    # Mean number of ids per sample (1 for one-hot features, >1 for multi-hot).
    pooling_factor: float = 1.0
    # Access skew: ids are drawn with P(rank r) ~ r^-zipf_alpha; None means DEFAULT_ZIPF_ALPHA.
    zipf_alpha: Optional[float] = None
    # Planner constraints; None means "any the planner allows".
    sharding_types: Optional[List[ShardingType]] = None
    memory_tiers: Optional[List[MemoryTier]] = None
    weights_dtypes: Optional[List[WeightsDtype]] = None
    # Forced placement: the ranks the table's shards must go to (TW: one rank; CW/TWCW: one per slice).
    ranks: Optional[List[int]] = None
    # Column-wise / table-column-wise slice counts it may be cut into (1: one slice of the whole width); None means
    # the planner's (powers of two up to planner.max_column_slices, slices a multiple of 4 columns).
    column_slices: Optional[List[int]] = None

    @property
    def alpha(self) -> float:
        return DEFAULT_ZIPF_ALPHA if self.zipf_alpha is None else self.zipf_alpha

    @property
    def num_parameters(self) -> int:
        return self.num_embeddings * self.embedding_dim

    def check(self, key: str) -> None:
        checks.non_empty(f"{key}.name", self.name)
        checks.positive(f"{key}.num_embeddings", self.num_embeddings)
        checks.positive(f"{key}.embedding_dim", self.embedding_dim)
        checks.positive(f"{key}.pooling_factor", self.pooling_factor)
        if self.zipf_alpha is not None:
            checks.in_range(f"{key}.zipf_alpha", self.zipf_alpha, 0.0, 5.0)
        for sub in ("sharding_types", "memory_tiers", "weights_dtypes", "ranks", "column_slices"):
            value = getattr(self, sub)
            if value is not None:
                checks.non_empty(f"{key}.{sub}", value)
        if self.ranks is not None:
            for i, r in enumerate(self.ranks):
                checks.non_negative(f"{key}.ranks.{i}", r)
        for i, k in enumerate(self.column_slices or []):
            checks.positive(f"{key}.column_slices.{i}", k)


@dataclass
class ShrinkConfig:
    """The caps model.shrink=true applies: a copy of any model (a production one included) that plans and trains on
    a laptop (hardware=cpu_local). Defaults: 2 CPU ranks train dlrm_tiny-sized tables at hundreds of steps a minute;
    prod_856 shrunk holds 856 x 10,000 x 16 fp32 weights, 0.55 GB."""

    max_rows: int = 10_000
    max_dim: int = 16
    # Every MLP layer (bottom, top but its final 1) and the DCN low-rank dim.
    max_mlp_width: int = 128
    max_pooling: float = 4.0

    def check(self, key: str) -> None:
        for name in ("max_rows", "max_dim", "max_mlp_width", "max_pooling"):
            checks.positive(f"{key}.{name}", getattr(self, name))


@dataclass
class ModelConfig:
    name: str = MISSING
    tables: List[TableConfig] = MISSING
    num_dense_features: int = 13
    # Bottom MLP layer widths after the dense input; None means [512, 256, D] (D = the tables' embedding dim).
    bottom_mlp: Optional[List[int]] = None
    # Top ("over") MLP widths; must end in 1 (the logit).
    top_mlp: List[int] = field(default_factory=lambda: [512, 256, 1])
    # auto: dot when every table has one dim equal to the bottom MLP's output, else dcn (resolved and printed by
    # with_interaction_resolved when the config is loaded).
    interaction: Interaction = Interaction.auto
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 512
    # Planning-only models are too big to instantiate; mode=train refuses them.
    planning_only: bool = False
    # A laptop-sized copy: rows, dims, MLP widths and pooling capped at shrink_to (the table count, the dense
    # features and the interaction are kept); trainable whatever planning_only says.
    shrink: bool = False
    shrink_to: ShrinkConfig = field(default_factory=ShrinkConfig)

    @property
    def embedding_dims(self) -> List[int]:
        return [t.embedding_dim for t in self.tables]

    @property
    def bottom_layers(self) -> List[int]:
        if self.bottom_mlp is not None:
            return list(self.bottom_mlp)
        return [512, 256, self.tables[0].embedding_dim]

    @property
    def num_parameters(self) -> int:
        return sum(t.num_parameters for t in self.tables)

    def shrunk(self) -> tuple["ModelConfig", str]:
        """This model with shrink_to's caps applied, and a line saying what changed. Forced placements (ranks) are
        dropped: they name ranks of the cluster the model was written for."""
        cap = self.shrink_to
        tables = [dataclasses.replace(t, num_embeddings=min(t.num_embeddings, cap.max_rows),
                                      embedding_dim=min(t.embedding_dim, cap.max_dim),
                                      pooling_factor=min(t.pooling_factor, cap.max_pooling), ranks=None)
                  for t in self.tables]
        bottom = [min(w, cap.max_mlp_width) for w in self.bottom_layers]
        if self.bottom_mlp is None or self.bottom_layers[-1] == self.tables[0].embedding_dim:
            bottom[-1] = tables[0].embedding_dim   # the bottom MLP still ends at the embedding dim (dot needs it)
        small = dataclasses.replace(
            self, name=f"{self.name}_shrunk", tables=tables, bottom_mlp=bottom,
            top_mlp=[min(w, cap.max_mlp_width) for w in self.top_mlp[:-1]] + [self.top_mlp[-1]],
            dcn_low_rank_dim=min(self.dcn_low_rank_dim, cap.max_mlp_width), planning_only=False, shrink=False)
        rows = sum(t.num_embeddings for t in self.tables)
        note = (f"model.shrink=true: {self.name} -> {small.name}: {len(tables)} tables, rows <= {cap.max_rows:,}, dims"
                f" <= {cap.max_dim}, pooling <= {cap.max_pooling:g}, MLP widths <= {cap.max_mlp_width}:"
                f" {rows:,} -> {sum(t.num_embeddings for t in tables):,} rows, {self.num_parameters:,} ->"
                f" {small.num_parameters:,} embedding parameters (model.shrink_to.* sets the caps)")
        return small, note

    def with_interaction_resolved(self) -> tuple["ModelConfig", str | None]:
        """This model with interaction=auto replaced by the one that fits its tables, and a line saying the choice
        (None when nothing was chosen)."""
        if self.interaction is not Interaction.auto or not self.tables:
            return self, None
        dims = sorted(set(self.embedding_dims))
        if len(dims) > 1:
            why = f"embedding dims differ: {dims}"
        elif self.bottom_layers[-1] != dims[0]:
            why = f"the last bottom layer {self.bottom_layers[-1]} is not embedding_dim={dims[0]}"
        else:
            return dataclasses.replace(self, interaction=Interaction.dot), (
                f"model.interaction=auto -> dot (every table has embedding_dim={dims[0]})")
        return dataclasses.replace(self, interaction=Interaction.dcn), f"model.interaction=auto -> dcn ({why})"

    def check(self, key: str = "model") -> None:
        checks.non_empty(f"{key}.name", self.name)
        checks.non_empty(f"{key}.tables", self.tables)
        for i, t in enumerate(self.tables):
            t.check(f"{key}.tables.{i}")
        checks.unique(f"{key}.tables", [t.name for t in self.tables])
        checks.non_negative(f"{key}.num_dense_features", self.num_dense_features)
        self.shrink_to.check(f"{key}.shrink_to")
        if self.bottom_mlp is not None:
            checks.non_empty(f"{key}.bottom_mlp", self.bottom_mlp)
            checks.all_positive(f"{key}.bottom_mlp", self.bottom_mlp)
        checks.non_empty(f"{key}.top_mlp", self.top_mlp)
        checks.all_positive(f"{key}.top_mlp", self.top_mlp)
        if self.top_mlp[-1] != 1:
            raise ConfigError(f"{key}.top_mlp", list(self.top_mlp), "the last layer must have width 1 (the logit)")
        if self.interaction is Interaction.dot:
            dims = sorted(set(self.embedding_dims))
            if len(dims) > 1:
                raise ConfigError(
                    f"{key}.interaction", "dot",
                    f"dot interaction needs one embedding_dim for all tables, got {dims}; use interaction=dcn")
            if self.bottom_layers[-1] != dims[0]:
                raise ConfigError(
                    f"{key}.bottom_mlp", list(self.bottom_layers),
                    f"the last bottom layer must equal embedding_dim={dims[0]} for dot interaction")
        else:
            checks.positive(f"{key}.dcn_num_layers", self.dcn_num_layers)
            checks.positive(f"{key}.dcn_low_rank_dim", self.dcn_low_rank_dim)
