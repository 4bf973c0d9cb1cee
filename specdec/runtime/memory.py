"""glibc's malloc, set for the model services' per-step temporaries.

A sampled verify on a large vocabulary makes and frees tensors of a few MB every
step (p, the residual and the cumulative sums over [gamma + 1, vocab]; 3 MB a
row-set at 151,936 tokens). With glibc's defaults the freed memory at the top of
the heap goes back to the system (trimmed), and the next step faults it in again
page by page. Measured on the project's VM (``docs/benchmarks.md``, "Large
temporaries and glibc's malloc"): ``verify_draft`` at 151,936 tokens took 5-13 ms
per gamma-4 step with the defaults (it varies from one process to the next) and
3.8-4.5 ms with large allocations kept on the heap and 256 MB of free heap kept.

``keep_freed`` sets that (``mallopt``) in a service process at start-up, before
the model loads, when its ``keep_freed_mb`` asks for it (off by default: on the
demo pair's 4,096 tokens the arithmetic did not change, and an end-to-end check
was too noisy to tell). Elsewhere (musl, macOS) it does nothing.
Not for: torch's own caching (CUDA memory is torch's allocator's, not malloc's).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit systems


def keep_freed(trim_mb: int) -> bool:
    """Keep up to ``trim_mb`` MB of freed memory in this process's heap, and serve
    allocations up to 32 MB from the heap (not each from its own mapping). 0: leave
    glibc's defaults. True if set."""
    if trim_mb <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    ok = ok and mallopt(M_TRIM_THRESHOLD, trim_mb << 20) == 1
    if not ok:
        log.warning("mallopt refused the settings; glibc's defaults stay")
    return ok
