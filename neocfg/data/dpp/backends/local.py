"""`dsi.backend=local`: worker processes on the trainer's host, one service per rank (neocfg/data/dpp/local.py)."""

from neocfg.data.dpp.backends import Backend


def _make(setup, options):
    from neocfg.data.dpp.local import LocalDppService

    return LocalDppService(setup)


BACKEND = Backend(job_wide=False, make=_make)
