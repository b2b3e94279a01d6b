"""Whether memory placed by the allocator is as fast to use: the same kernels
timed on tensors allocated after a fragmenting warm-up. Used by
`checks.py kernel_speed`.

An allocator decides where tensors live: in one `cudaMalloc` segment, in
handles of 2-20 MiB mapped side by side, or (gpualloc's stitches) in
handles from anywhere mapped into one range. Kernels see only virtual
addresses, but the GPU's address translation may not: if a layout made
kernels slower, training would pay for it at every step with no allocator
call in sight. This check times a streaming copy, a random gather over
4 GiB (the access pattern most sensitive to translation), a softmax the
size of GPT-2's logits and a bf16 matmul, each as the median of 20 runs
between CUDA events; the copy once more on tensors allocated first, in an
untouched cache; and, in wall-clock time, what a host-bound loop pays per
sync: `.item()` of a random element of the 4 GiB tensor and a `nonzero`."""

from __future__ import annotations

import random
import statistics
import time

MiB = 1 << 20


def _fragment(torch, dev):
    """Allocates and frees tensors of random sizes (about 12 GiB at the
    high-water mark) and keeps every fifth, so that the cache holds freed
    memory scattered among live blocks when the measured tensors arrive."""
    rng = random.Random(11)
    live = [torch.empty(rng.randint(1, 64) * MiB, dtype=torch.uint8, device=dev) for _ in range(400)]
    kept = live[::5]
    del live
    more = [torch.empty(rng.randint(1, 48) * MiB, dtype=torch.uint8, device=dev) for _ in range(200)]
    kept += more[::7]
    del more
    return kept


def _time(torch, fn, runs=20):
    """Median milliseconds of `fn` over `runs` runs, after three warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _host_us(fn, runs=2000):
    """Mean wall-clock microseconds of `fn`, which waits for the GPU itself
    (a copy to the host), after 50 warm-ups."""
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(runs):
        fn()
    return (time.perf_counter() - t0) / runs * 1e6


def check_kernel_speed(args) -> dict:
    import torch

    dev = torch.device("cuda:0")
    n = 1 << 30  # 4 GiB of float32
    # The same copy on tensors that an untouched cache places.
    src, dst = torch.rand(n, device=dev), torch.empty(n, device=dev)
    fresh = _time(torch, lambda: dst.copy_(src))
    del src, dst
    kept = _fragment(torch, dev)
    src = torch.rand(n, device=dev)
    dst = torch.empty_like(src)
    idx = torch.randint(0, n, (1 << 26,), device=dev)
    logits = torch.randn(16 * 768, 50257, device=dev)
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    kernels = {
        "copy_4gib": lambda: dst.copy_(src),
        "gather_64m_of_1g": lambda: torch.index_select(src, 0, idx, out=dst[: 1 << 26]),
        "softmax_gpt2_logits": lambda: torch.softmax(logits, dim=-1),
        "matmul_bf16_8192": lambda: torch.matmul(x, x, out=y),
    }
    ms = {"copy_4gib_fresh": fresh} | {name: _time(torch, fn) for name, fn in kernels.items()}
    # What a host-bound loop pays at each sync: a 4-byte read of a random
    # place in the 4 GiB tensor (`.item()` of a view: one copy to the host
    # from a random 2 MiB page of 2,048), and a `nonzero`.
    rng = random.Random(12)
    mask = torch.rand(1 << 16, device=dev) > 0.5
    host = {
        "item_random_place": _host_us(lambda: float(src[rng.randrange(n)])),
        "nonzero_64k": _host_us(lambda: mask.nonzero()),
    }
    out = {
        "median_ms": ms,
        "host_us": host,
        "copy_gb_per_s": 2 * n * 4 / (ms["copy_4gib"] * 1e-3) / 1e9,
        "peak_reserved_over_allocated": torch.cuda.max_memory_reserved() / max(1, torch.cuda.max_memory_allocated()),
    }
    from checks import _counters

    out["counters"] = _counters()
    del kept
    return out
