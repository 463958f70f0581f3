"""release_openmp_pool frees the calling thread's OpenMP workers and changes nothing else."""
import subprocess
import sys
import textwrap

import pytest
import torch

from dspark.models.openmp_pool import loaded_openmp_runtimes, release_openmp_pool

PROBE = textwrap.dedent("""
    import os, torch
    from dspark.models.openmp_pool import release_openmp_pool
    torch.set_num_threads(2)
    threads = lambda: len(os.listdir("/proc/self/task"))
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    before = a @ b                       # a parallel region: this thread's pool gets its worker
    with_pool = threads()
    released = release_openmp_pool()
    after_release = threads()
    again = a @ b                        # the next region builds a new pool
    print(released, with_pool - after_release, threads() - after_release, torch.get_num_threads(),
          bool(torch.equal(before, again)))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_release_frees_the_pool_and_keeps_results_and_settings():
    if not any("gomp" in p or "omp" in p for p in loaded_openmp_runtimes()):
        pytest.skip("torch is not built with an OpenMP runtime here")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    released, freed, rebuilt, num_threads, same = out.stdout.split()
    assert int(released) >= 1
    assert int(freed) >= 1 and int(rebuilt) >= 1  # the worker went away, and came back with the next region
    assert int(num_threads) == 2 and same == "True"


def test_release_without_a_pool_is_harmless():
    torch.ones(2).sum()
    assert release_openmp_pool() >= 0
    assert torch.ones(3).sum().item() == 3.0
