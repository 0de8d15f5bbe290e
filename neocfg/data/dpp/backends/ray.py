"""`dsi.backend=ray`: one master actor for the job, worker actors anywhere in a Ray cluster
(neocfg/data/dpp/ray_backend.py; Ray is imported only when the backend is used)."""

from neocfg.data.dpp.backends import Backend
from neocfg.errors import ConfigError


def _ray_backend():
    try:
        from neocfg.data.dpp import ray_backend
    except ImportError as exc:
        raise ConfigError("dsi.backend", "ray", f"needs Ray ({exc}); install it with pip install 'neocfg[ray]'") \
            from None
    return ray_backend


def _make(setup, options):
    return _ray_backend().RayDppService(setup, options)


def _connect(dsi, rank, share, sizing, workers):
    return _ray_backend().connect(dsi, rank, share, sizing, workers)


BACKEND = Backend(job_wide=True, make=_make, connect=_connect)
