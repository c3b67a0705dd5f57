"""What a rank measures of itself: its peak resident memory (`peak_rss_mb`), and giving the
C heap's free pages back between a round's phases (`release_free_memory`).
"""

from __future__ import annotations

import resource
from typing import Any

__all__ = ["peak_rss_mb", "release_free_memory"]

_LIBC: Any = None  # glibc, once loaded (False: not there, or it has no malloc_trim)


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`, every arena):
    called between a round's phases, so that what a phase freed (activations, gradients,
    serialised bytes, decoded tensors) stops counting in the rank's resident memory rather
    than lingering in the heap, where the next phase's differently sized buffers would not
    fit and would take fresh pages. A no-op where the C library has no such call."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def peak_rss_mb() -> float:
    """This rank's own peak resident memory. Not `ru_maxrss`: Linux carries the launching
    process's peak into a spawned child's (exec records the old address space's high-water
    mark), so a rank started by a 2 GB parent reported 2 GB. `VmHWM` is the peak of the
    rank's own address space."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
