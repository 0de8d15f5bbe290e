"""A DPP service: one backend and the clients of this process, with the position to checkpoint and resume from."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from neocfg.data.dpp.backend import DppBackend
from neocfg.data.dpp.backends import backend_of
from neocfg.data.dpp.client import DppClient
from neocfg.data.dpp.master import DppStats, ServiceSetup
from neocfg.data.dpp.progress import ClientMark, Position
from neocfg.types import DppBackendKind


def make_backend(kind: DppBackendKind, setup: ServiceSetup, options: Any = None) -> DppBackend:
    """`options`: what the backend's connect returned (the Ray backend's RayOptions), None for a per-rank one."""
    return backend_of(kind).make(setup, options)


class DppService:
    """`clients`: the client indices served in this process (default: all of setup.num_clients); a job-wide Ray
    service has one client per trainer rank, each in its own process."""

    def __init__(self, setup: ServiceSetup, kind: DppBackendKind = DppBackendKind.local,
                 clients: Optional[Sequence[int]] = None, backend: Optional[DppBackend] = None) -> None:
        self.setup = setup
        self.backend: DppBackend = backend or make_backend(kind, setup)
        ids = list(range(setup.num_clients)) if clients is None else list(clients)
        self.clients = [DppClient(self.backend, i, setup.spec.batch_size, setup.limits.stall_timeout_s, setup.start)
                        for i in ids]
        if setup.num_clients == 1:  # several clients share the owed splits however they come: no order to keep
            self.clients[0].resume_order(setup.start.pending)

    def start(self) -> "DppService":
        self.backend.start()
        return self

    def position(self, marks: Optional[dict[int, ClientMark]] = None) -> Position:
        """What all clients delivered (up to `marks`, per client index; default: now): the point a new service
        (ServiceSetup.start) continues from. A job-wide backend waits for every process's clients here."""
        marks = marks or {c.index: c.mark() for c in self.clients}
        step = marks[self.clients[0].index].batches if self.clients else 0
        return self.backend.position(step, {c.index: c.consumed(marks[c.index]) for c in self.clients})

    def checkpoint(self, path: Path) -> Position:
        """Save the service's position (the master's progress as the clients delivered it) to a JSON file."""
        pos = self.position()
        pos.save(path)
        return pos

    def stats(self) -> DppStats:
        return self.backend.stats()

    def close(self) -> None:
        self.backend.close()
        for c in self.clients:
            if c.log is not None:
                c.log.close()

    def __enter__(self) -> "DppService":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
