"""Bytes and seconds as people read them, for the log, the console and the page."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units; plain bytes below 1 KiB)."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def human_time(seconds: float) -> str:
    """Seconds in the unit that keeps 1-3 integer digits: '18.1 µs', '407.8 ms', '23.4 s'."""
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.1f} s"
