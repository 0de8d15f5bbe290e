"""A DPP service: one backend and its clients, with the position to checkpoint and resume from."""

from __future__ import annotations

from pathlib import Path

from neocfg.data.dpp.backend import DppBackend, DppStats, ServiceSetup, make_backend
from neocfg.data.dpp.client import DppClient
from neocfg.data.dpp.progress import Position, Tracker
from neocfg.types import DppBackendKind


class DppService:
    def __init__(self, setup: ServiceSetup, kind: DppBackendKind = DppBackendKind.local) -> None:
        self.setup = setup
        self.backend: DppBackend = make_backend(kind, setup)
        n = len(setup.splits)
        self.clients = [DppClient(self.backend, i, setup.spec.batch_size, Tracker(n, setup.start),
                                  setup.limits.stall_timeout_s) for i in range(setup.num_clients)]
        if setup.num_clients == 1:  # several clients share the owed splits however they come: no order to keep
            self.clients[0].resume_order(setup.start.pending)

    def start(self) -> "DppService":
        self.backend.start()
        return self

    def position(self) -> Position:
        """What all clients delivered: the point a new service (ServiceSetup.start) continues from."""
        return Position.merge([c.position() for c in self.clients], len(self.setup.splits))

    def checkpoint(self, path: Path) -> Position:
        """Save the service's position (the master's progress as the clients delivered it) to a JSON file."""
        pos = self.position()
        pos.save(path)
        return pos

    def stats(self) -> DppStats:
        return self.backend.stats()

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> "DppService":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
