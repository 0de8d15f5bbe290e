"""Typed configuration: one schema module per config section, checks that name the full key path."""

from pathlib import Path

# The Hydra config tree the CLI composes (conf/ beside the package).
CONF_DIR = Path(__file__).resolve().parent.parent.parent / "conf"
