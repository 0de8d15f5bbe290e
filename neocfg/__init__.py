"""neocfg: declarative planning and training of large-scale DLRMs."""

__version__ = "0.1.0"
