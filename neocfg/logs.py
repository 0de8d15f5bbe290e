"""Logging set-up shared by the CLI and the ranks."""

from __future__ import annotations

import logging


class _DropLibraryInfo(logging.Filter):
    """fbgemm_gpu logs ~50 INFO lines per process (libraries loaded, every TBE's arguments) through the root
    logger, which Hydra sets to INFO: keep its warnings and errors only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "fbgemm_gpu" not in record.pathname


def quiet_library_logs() -> None:
    root = logging.getLogger()
    if not any(isinstance(f, _DropLibraryInfo) for f in root.filters):
        root.addFilter(_DropLibraryInfo())
