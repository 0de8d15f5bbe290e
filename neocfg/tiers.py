"""One home per memory tier: where a table's weights live, what the device holds of them, and what fbgemm and TorchRec
call the tier. The planner's cost model (storage, lookup rate), the runtime's TBEs and the TorchRec converters all
read `TIERS`, so they cannot drift apart.

Adding a memory tier: a `MemoryTier` member and its `Tier` in `TIERS` (docs/architecture.md; the checklist test adds
a toy tier that way and plans it).
"""

from __future__ import annotations

from dataclasses import dataclass

from neocfg.types import MemoryTier


@dataclass(frozen=True)
class Tier:
    tier: MemoryTier
    # The weights and optimizer state sit in device memory (HBM); otherwise in host DDR, read over PCIe (UVM).
    on_device: bool
    # An HBM cache of planner.cache_ratio of the rows in front of host-resident weights (fbgemm's UVM caching):
    # lookups hit it at a Zipf rate, misses read the host.
    hbm_cache: bool
    # fbgemm's EmbeddingLocation member on CUDA (CPU ranks keep every table in their own memory).
    fbgemm_location: str
    # TorchRec's compute kernel of a sharded (not data-parallel) table in this tier.
    torchrec_kernel: str

    def __post_init__(self) -> None:
        if self.on_device and self.hbm_cache:
            raise ValueError(f"tier {self.tier.value}: a cache in front of weights already on the device")


TIERS: dict[MemoryTier, Tier] = {t.tier: t for t in (
    Tier(MemoryTier.hbm, on_device=True, hbm_cache=False, fbgemm_location="DEVICE", torchrec_kernel="fused"),
    Tier(MemoryTier.uvm_caching, on_device=False, hbm_cache=True, fbgemm_location="MANAGED_CACHING",
         torchrec_kernel="fused_uvm_caching"),
    Tier(MemoryTier.host, on_device=False, hbm_cache=False, fbgemm_location="MANAGED", torchrec_kernel="fused_uvm"),
)}
assert set(TIERS) == set(MemoryTier), "every MemoryTier needs a Tier in neocfg.tiers.TIERS"
