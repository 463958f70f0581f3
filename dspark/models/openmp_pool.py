"""Release the calling thread's OpenMP thread pool before another thread takes over the CPU compute.

torch's CPU kernels run on OpenMP, and OpenMP keeps one pool of worker threads per thread that ever ran
a parallel region. GNU OpenMP (the libgomp torch ships on Linux) counts the workers of every pool, idle
ones included, and once they outnumber the CPUs it stops spin-waiting between parallel regions: each
of the hundreds of regions in a forward then hands work over through a futex sleep and wake-up. A
Serve replica builds its engine in one thread (loading the drafter and profiling the SPS table run
forwards there) and steps it in another, so a replica with a drafter left a second pool behind and its
engine thread kept the second core busy only half the time: on 2 cores, the same target-only steps ran
10-20 % slower than in a replica without a drafter (benchmarks/engine_thread.py measures both, side by
side; benchmarks/serve_load.py through Ray Serve). `omp_pause_resource_all` (OpenMP 5.0) frees the
calling thread's pool; the next parallel region in that thread simply builds a new one.

Invariant: only the calling thread's idle workers are released; results and thread settings
(`torch.get_num_threads`) are unchanged.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings
_RUNTIMES = ("libgomp", "libomp", "libiomp5")


def loaded_openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux /proc; empty elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in maps if "/" in line}
    return sorted(p for p in paths if Path(p).name.startswith(_RUNTIMES))


def release_openmp_pool() -> int:
    """Free the calling thread's OpenMP worker threads in every loaded OpenMP runtime; returns how many
    runtimes did so (0 where none is loaded or none supports OpenMP 5.0 pausing)."""
    released = 0
    for path in loaded_openmp_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all  # the already loaded library: no new copy
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(OMP_PAUSE_SOFT) == 0:
            released += 1
        else:
            log.debug("omp_pause_resource_all failed in %s", path)
    return released
