"""Records a small training-like trace on the simulated device that ends in
a fragmentation OOM: steps with forward, backward and optimizer phases and a
mark each, a checkpoint save every fourth step, an evaluation pass, one
tensor kept per step (a leak), and a pause. Needs no GPU and no torch.

Usage: python3 make_trace.py OUT.gtrace  (with GPUALLOC_LIBRARY set)
"""

import os
import sys
import time

os.environ["GPUALLOC_BACKEND"] = "sim"
os.environ["GPUALLOC_SIM_CAPACITY"] = "1GiB"
os.environ["GPUALLOC_SIM_DEVICES"] = "1"
os.environ["GPUALLOC_CONF"] = "policy:pytorch"
os.environ.pop("GPUALLOC_TRACE", None)

from gpualloc import GpuallocError  # noqa: E402
from gpualloc._lib import lib  # noqa: E402

MiB = 1 << 20


def main(out: str) -> None:
    g = lib()
    g.trace_start(out)
    weights = [g.malloc(8 * MiB) for _ in range(8)]
    kept = []
    for step in range(12):
        scale = 1 + step % 3
        g.phase_push("forward")
        acts = [g.malloc(scale * (2 + k % 5) * MiB) for k in range(16)]
        g.phase_pop()
        g.phase_push("backward")
        for p in reversed(acts):
            grad = g.malloc(3 * MiB)
            g.free(p)
            g.free(grad)
        g.phase_pop()
        g.phase_push("optimizer")
        kept.append(g.malloc(256 * 1024))
        g.phase_pop()
        if step % 4 == 3:
            g.phase_push("checkpoint_save")
            copy = [g.malloc(16 * MiB) for _ in weights]
            time.sleep(0.02)
            for p in copy:
                g.free(p)
            g.phase_pop()
        g.mark("step")
        time.sleep(0.005)
    g.phase_push("eval")
    outs = [g.malloc(6 * MiB) for _ in range(10)]
    for p in outs:
        g.free(p)
    g.phase_pop()
    time.sleep(0.2)  # a quiet stretch: the charts must stay flat across it
    # Fragmentation: 4 MiB blocks fill 20 MiB segments; keeping one block in
    # five pins every segment, so the cache holds much free memory in pieces
    # too small for the last request.
    g.empty_cache()
    g.phase_push("forward")
    free, _ = g.mem_info()
    blocks = [g.malloc(4 * MiB) for _ in range(free // (20 * MiB) * 5)]
    for k, p in enumerate(blocks):
        if k % 5 != 0:
            g.free(p)
    try:
        g.malloc(100 * MiB)
        raise SystemExit("make_trace: expected an out-of-memory error")
    except GpuallocError:
        pass
    g.phase_pop()
    g.trace_stop()


if __name__ == "__main__":
    main(sys.argv[1])
