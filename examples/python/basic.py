"""gpualloc from a Python script, without PyTorch, on the simulated device.

From the repository root::

    cargo build --release -p gpualloc-capi
    GPUALLOC_LIBRARY=target/release/libgpualloc.so PYTHONPATH=python-shim \\
        python3 examples/python/basic.py basic.gtrace
    gpualloc summary basic.gtrace
    gpualloc leaks basic.gtrace

(after ``pip install ./python-shim``, ``python3 examples/python/basic.py``
is enough). The trace path is optional.

A training script needs only ``gpualloc.install()`` before CUDA starts: then
PyTorch makes the allocations. Here, without PyTorch, the script makes them
itself through the library handle (``gpualloc._lib.lib()``), in four
"training steps" whose optimizer keeps one 4 KiB block per step: the leak
``gpualloc leaks`` finds.
"""

import os
import sys

# The simulated device unless the environment names another backend; read
# when the library starts, so before the first call.
os.environ.setdefault("GPUALLOC_BACKEND", "sim")
os.environ.setdefault("GPUALLOC_SIM_CAPACITY", "4GiB")

import gpualloc  # noqa: E402
from gpualloc._lib import lib  # noqa: E402

MiB = 1 << 20


def step(n, kept):
    """One training step: activations, their release, and a kept block."""
    with gpualloc.phase("forward"):
        acts = [lib().malloc(size) for size in (8 * MiB * (n + 1), 3 * MiB, 1000)]
    with gpualloc.phase("backward"):
        for p in reversed(acts):
            lib().free(p)
    with gpualloc.phase("optimizer"):
        kept.append(lib().malloc(4096))
    gpualloc.mark(f"step {n}")


def main(argv):
    trace = argv[1] if len(argv) > 1 else None
    print(f"gpualloc {gpualloc.version()} on the {gpualloc.backend()} backend")
    if trace:
        gpualloc.trace_start(trace)

    kept = []
    for n in range(4):
        step(n, kept)
    s = gpualloc.stats()  # torch.cuda.memory_stats()'s names
    print(f"after 4 steps: {s['allocation.all.current']} blocks alive, "
          f"{s['allocated_bytes.all.current']} B allocated, "
          f"peak {s['allocated_bytes.all.peak']} B, reserved {s['reserved_bytes.all.current']} B")
    f = gpualloc.fragmentation()
    print(f"largest free block {f['largest_free_block']} B of {f['cached_free_bytes']} B cached")

    try:
        lib().malloc(64 << 30)
    except gpualloc.GpuallocError as e:
        oom = gpualloc.last_oom()
        print(f"out of memory: {oom['requested']} B requested, never fits: the most it can get is {oom['device_total']} B")
        print(f"  {e}")

    if trace:  # stopped before the kept blocks are freed: they leak in the trace
        t = gpualloc.trace_stop()
        print(f"trace {trace}: {t['events']} events, {t['bytes']} bytes, {t['dropped']} dropped")
    for p in kept:
        lib().free(p)
    gpualloc.empty_cache()
    print(gpualloc.summary(abbreviated=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
