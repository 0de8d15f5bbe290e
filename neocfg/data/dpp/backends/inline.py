"""`dsi.backend=inline`: splits processed in the caller's thread, no parallelism (eval sources, tests)."""

from neocfg.data.dpp.backend import InlineDppService
from neocfg.data.dpp.backends import Backend

BACKEND = Backend(job_wide=False, make=lambda setup, options: InlineDppService(setup))
