"""The DPP backends, one module each: `dsi.backend=<module name>`.

A backend module defines BACKEND, a Backend: whether it serves the whole job (one service shared by every rank,
split indices over the whole dataset) or one rank (a service per rank over the rank's share of the splits), how to
make its DppBackend (neocfg/data/dpp/backend.py) and, for a job-wide one, how the ranks connect to it. The module
must import cheaply (no heavy or optional dependency at import: `neocfg describe` lists backends without them); a
per-rank backend with workers needs only a WorkerPool (neocfg/data/dpp/loop.py) and InProcessService around it.
DppBackendKind (neocfg/types.py) has one member per module of this package.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

from neocfg.data.dpp.backend import DppBackend
from neocfg.data.dpp.master import ServiceSetup
from neocfg.types import DppBackendKind

# connect(dsi, rank, share, sizing, workers) -> (options for make, rank 0's lines to say): a collective over ranks.
Connect = Callable[..., tuple[Any, str]]


@dataclass(frozen=True)
class Backend:
    job_wide: bool
    # make(setup, options): options is what connect returned (None for a backend without connect).
    make: Callable[[ServiceSetup, Any], DppBackend]
    connect: Optional[Connect] = None


def backend_of(kind: DppBackendKind) -> Backend:
    module = importlib.import_module(f"{__name__}.{kind.value}")
    found = getattr(module, "BACKEND", None)
    if not isinstance(found, Backend):
        raise TypeError(f"DPP backend module {module.__name__} defines no BACKEND = Backend(...)")
    return found
