"""The allocator's four counters (allocated, reserved and their peaks) read from the stats dicts torch returns."""
from __future__ import annotations

__all__ = ["counters_from_stats"]


def counters_from_stats(stats: dict) -> tuple:
    """``(allocated, reserved, peak_allocated, peak_reserved)`` from a nested or flat stats dict.

    Accepts both shapes torch produces: ``_cuda_memoryStats``' nested
    ``{"allocated_bytes": {"all": {"current": ...}}}`` and ``memory_stats()``' flat
    ``{"allocated_bytes.all.current": ...}``. An empty dict (allocator not initialized) gives Nones.
    """
    def get(stat: str, key: str):
        nested = stats.get(stat)
        if isinstance(nested, dict):
            value = nested.get("all", {}).get(key)
        else:
            value = stats.get(f"{stat}.all.{key}")
        return None if value is None else int(value)

    return (
        get("allocated_bytes", "current"),
        get("reserved_bytes", "current"),
        get("allocated_bytes", "peak"),
        get("reserved_bytes", "peak"),
    )
