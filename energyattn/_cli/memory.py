"""The memory a command's sizes need, checked before the work: sizes too large for the machine
are a one-line error naming them, not an out-of-memory traceback minutes later."""

import os


def physical_memory() -> int | None:
    """The machine's physical memory in bytes, or `None` where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name
        return None


def format_bytes(size: int) -> str:
    """`size` bytes in binary units: `512 bytes`, `1.5 GiB`, `88.0 TiB`."""
    units = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")
    power = 0
    while power < len(units) - 1 and size >= 1024 ** (power + 1):
        power += 1
    return f"{size} bytes" if power == 0 else f"{size / 1024**power:.1f} {units[power]}"


def check_memory(needed: int, sizes: str) -> None:
    """A `ValueError` (the commands' bad-argument error) when a run's largest arrays need
    more than the machine's memory. `needed` is a lower bound in bytes; `sizes` names the
    arguments that set it, e.g. `"num_points=1000000"`."""
    have = physical_memory()
    if have is not None and needed > have:
        raise ValueError(
            f"{sizes} would need at least {format_bytes(needed)} of memory for the largest "
            f"arrays, more than the {format_bytes(have)} of this machine: use smaller sizes"
        )
