"""Units used across neocfg: binary capacities (GiB), decimal bandwidths (GB/s), and their formatting."""

from __future__ import annotations

KIB, MIB, GIB, TIB = 1024, 1024**2, 1024**3, 1024**4
GB = 10**9  # bandwidths are in GB/s = 10^9 bytes per second


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'; binary units, three significant figures."""
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{int(n)} B"
