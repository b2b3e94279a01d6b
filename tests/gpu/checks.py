"""GPU checks, one per process: `python3 tests/gpu/checks.py NAME --alloc native|gpualloc [--steps N]`.

A process can have only one CUDA allocator, so the driver (driver.py) runs
every check once per allocator in its own subprocess. Each prints one line
`GPUALLOC_RESULT <json>` at the end; everything else is diagnostics.

Checks: dropin (what training code expects of the allocator), streams (data
integrity across streams and record_stream), threads, multi_device,
train_resnet, train_gpt2, train_detector, train_backbone (training steps
timed, with the allocator's counters; train_resnet_small and
train_detector_small the first and third on small footprints), churn, churn_cpp and trace_cpp
(allocator calls from C++: a loop, and a recorded trace's), kernel_speed (kernels on
memory placed after a fragmenting warm-up), auto_marks (the step marks
and phases install() records by itself), launcher (`python -m gpualloc
run` on an unchanged program with DataLoader workers and a spawned
process), promise (requests the bound says fit, under a fixed budget,
after fragmenting sequences: promise.py) and max_batch (the largest
batch of a workload under a memory budget):

    python3 tests/gpu/checks.py max_batch --alloc native --workload backbone --budget-gib 12
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import threading
import time
import traceback
from typing import Callable, NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import churn_cpp  # noqa: E402 - needs HERE on the path
import compat  # noqa: E402
import kernel_speed  # noqa: E402
import launcher  # noqa: E402
import promise  # noqa: E402

MiB = 1 << 20


def setup(alloc: str) -> dict:
    """Installs gpualloc (before anything touches CUDA) or keeps PyTorch's allocator."""
    info = {"alloc": alloc}
    if alloc == "raw":
        info["install_mode"] = _install_raw()
    elif alloc == "gpualloc":
        import gpualloc

        t0 = time.time()
        info["config"] = os.environ.get("GPUALLOC_TEST_CONF") or ""
        info["trace"] = os.environ.get("GPUALLOC_TEST_TRACE") or None
        info["install_mode"] = gpualloc.install(config=info["config"] or None, trace=info["trace"])
        info["install_s"] = round(time.time() - t0, 2)
    import torch

    info["torch"] = torch.__version__
    info["device"] = torch.cuda.get_device_name(0)
    info["backend"] = torch.cuda.get_allocator_backend()
    info["pytorch_alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    return info


def _install_raw() -> str:
    """The route without the Python package, exactly as README.md shows it:
    PyTorch's own CUDAPluggableAllocator on libgpualloc.so, with the hooks
    that C functions can fill set by hand."""
    import ctypes

    import torch

    path = os.environ["GPUALLOC_LIBRARY"]
    alloc = torch.cuda.memory.CUDAPluggableAllocator(path, "gpualloc_malloc_or_raise", "gpualloc_free")
    lib = ctypes.CDLL(path)
    for setter, fn in (("set_reset_fn", lib.gpualloc_empty_cache),
                       ("set_memory_fraction_fn", lib.gpualloc_set_memory_fraction),
                       ("set_record_stream_fn", lib.gpualloc_record_stream)):
        getattr(alloc.allocator(), setter)(ctypes.cast(fn, ctypes.c_void_p).value)
    torch.cuda.memory.change_current_allocator(alloc)
    _RAW.append(alloc)
    return "raw"


def _installing_child(alloc: str) -> str:
    """The opening of a child process's program that installs the
    allocator `alloc` as checks.py's runs do (`--alloc`)."""
    import textwrap

    return textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {HERE!r})
        import checks
        alloc = {alloc!r}
        if alloc == "raw":
            checks._install_raw()
        elif alloc == "gpualloc":
            import gpualloc
            gpualloc.install(config=os.environ.get("GPUALLOC_TEST_CONF") or None)
    """)


_RAW = []  # the raw route's allocator object, alive for the whole run


def result(payload: dict) -> None:
    print("GPUALLOC_RESULT " + json.dumps(payload, default=str), flush=True)


# ---------------------------------------------------------------------------
# dropin: each sub-check passes or fails on its own


def check_dropin(args) -> dict:
    import torch

    out = {}
    # PyTorch's plain CUDAPluggableAllocator (gpualloc's fallback, or the
    # library loaded without the Python package) cannot raise
    # torch.cuda.OutOfMemoryError: gpualloc_malloc_or_raise throws a C++
    # std::runtime_error, a RuntimeError in Python (oom_is_catchable checks
    # it), so the sub-checks that expect OutOfMemoryError are skipped.
    pluggable = torch.cuda.get_allocator_backend() == "pluggable"

    def sub(name, fails_allocation=False):
        def deco(fn):
            if fails_allocation and pluggable:
                out[name] = {"ok": False, "error": "skipped: under a plain CUDAPluggableAllocator a failed allocation raises RuntimeError, not OutOfMemoryError (oom_is_catchable)"}
                return fn
            try:
                v = fn()
                out[name] = {"ok": True, **({"value": v} if v is not None else {})}
            except Exception as e:  # noqa: BLE001 - every failure is reported, not fatal
                out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600]}
            return fn

        return deco

    dev = torch.device("cuda:0")

    @sub("memory_allocated")
    def _():
        base = torch.cuda.memory_allocated()
        x = torch.empty(4 * MiB, dtype=torch.uint8, device=dev)
        grown = torch.cuda.memory_allocated() - base
        assert grown >= 4 * MiB, f"grew by {grown}"
        assert torch.cuda.memory_reserved() >= torch.cuda.memory_allocated()
        assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
        del x
        assert torch.cuda.memory_allocated() == base, "not back to the base after free"
        return grown

    @sub("memory_stats_keys")
    def _():
        s = torch.cuda.memory_stats()
        for k in ("allocated_bytes.all.current", "reserved_bytes.all.peak", "num_alloc_retries", "segment.large_pool.current", "active_bytes.all.current", "requested_bytes.all.current", "num_ooms"):
            assert k in s, f"missing {k}"
        return len(s)

    @sub("memory_summary")
    def _():
        s = torch.cuda.memory_summary()
        assert "Allocated memory" in s
        return len(s)

    if args.alloc == "gpualloc":

        @sub("held_adds_up_to_reserved")
        def _():
            # gpualloc.held(): reserved memory by the unit it can be given
            # back in, read from the running allocator (round 45's C ABI).
            import gpualloc

            xs = [torch.empty(n * MiB + 4096, dtype=torch.uint8, device=dev) for n in (1, 3, 40, 200)]
            del xs[1]
            torch.cuda.synchronize()
            h = gpualloc.held()
            parts = h["used_units"] + h["free_units"] + h["free_private_units"] + h["pooled"]
            assert parts == torch.cuda.memory_reserved(), f"{h} add up to {parts}, reserved {torch.cuda.memory_reserved()}"
            assert h["used_units"] >= torch.cuda.memory_allocated(), f"{h}, allocated {torch.cuda.memory_allocated()}"
            assert h["used_units_unallocated"] == h["used_units"] - torch.cuda.memory_allocated(), f"{h}, allocated {torch.cuda.memory_allocated()}"
            assert "reserved by unit: used" in gpualloc.summary()
            del xs
            return h

    @sub("reset_peak_memory_stats")
    def _():
        x = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
        del x
        assert torch.cuda.max_memory_allocated() > torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()

    @sub("reset_accumulated_memory_stats")
    def _():
        torch.cuda.reset_accumulated_memory_stats()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == 0

    @sub("oom_raises_OutOfMemoryError", fails_allocation=True)
    def _():
        free, total = torch.cuda.mem_get_info()
        try:
            torch.empty(total * 4, dtype=torch.uint8, device=dev)
        except torch.cuda.OutOfMemoryError as e:
            msg = str(e)
        else:
            raise AssertionError("no exception for 4x the device memory")
        # PyTorch's opening, which its own test_out_of_memory and scripts
        # match, for a request that never fits; its text from 1 EB on.
        opening = f"Tried to allocate {total * 4 / 2**30:.2f} GiB. GPU {dev.index or 0} has a total capacity of"
        assert opening in msg, f"{opening!r} not in {msg!r}"
        try:
            torch.empty(8_000_000_000 << 30, dtype=torch.uint8, device=dev)  # as PyTorch's test_out_of_memory
        except torch.cuda.OutOfMemoryError as e:
            assert "Tried to allocate more than 1EB memory" in str(e), str(e)
        else:
            raise AssertionError("no exception for 8 EB")
        y = torch.ones(1024, device=dev)  # still usable afterwards
        assert float(y.sum()) == 1024.0
        return msg[:300]

    @sub("oom_after_filling", fails_allocation=True)
    def _():
        # Fill the device in 1 GiB pieces until it refuses: an exception, never a NULL tensor.
        held = []
        try:
            for _ in range(1000):
                held.append(torch.empty(1 << 30, dtype=torch.uint8, device=dev))
        except torch.cuda.OutOfMemoryError:
            pass
        n = len(held)
        assert all(t.data_ptr() != 0 for t in held)
        del held
        torch.cuda.empty_cache()
        assert n > 0
        return n

    @sub("empty_cache_releases")
    def _():
        x = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
        del x
        before = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        after = torch.cuda.memory_reserved()
        assert after < before, f"{before} -> {after}"
        return before - after

    @sub("memory_fraction", fails_allocation=True)
    def _():
        torch.cuda.set_per_process_memory_fraction(0.25)
        try:
            assert abs(torch.cuda.get_per_process_memory_fraction() - 0.25) < 1e-9
            total = torch.cuda.get_device_properties(0).total_memory
            try:
                torch.empty(int(total * 0.5), dtype=torch.uint8, device=dev)
            except torch.cuda.OutOfMemoryError:
                pass
            else:
                raise AssertionError("half the device allocated under a 0.25 fraction")
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)

    @sub("cudnn_benchmark_conv")
    def _():
        torch.backends.cudnn.benchmark = True
        try:
            conv = torch.nn.Conv2d(16, 32, 3, padding=1).to(dev)
            y = conv(torch.randn(8, 16, 64, 64, device=dev))
            y.sum().backward()
            torch.cuda.synchronize()
        finally:
            torch.backends.cudnn.benchmark = False

    @sub("record_stream_call")
    def _():
        s = torch.cuda.Stream()
        x = torch.empty(MiB, device=dev)
        x.record_stream(s)
        del x
        torch.cuda.synchronize()

    @sub("cuda_graph_capture_replay")
    def _():
        static_x = torch.zeros(1 << 20, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm up outside the graph, as PyTorch recommends
                y = static_x * 2 + 1
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            static_y = static_x * 2 + 1
            static_z = static_y.sum()
        others = []
        for v in (1.0, 3.0):
            static_x.fill_(v)
            g.replay()
            torch.cuda.synchronize()
            assert float(static_z) == (v * 2 + 1) * (1 << 20), float(static_z)
            # Tensors of the temporaries' size made after the capture, on the
            # stream that captured (whose cache the temporaries went back to),
            # must not get memory the next replay writes.
            with torch.cuda.stream(s):
                others += [torch.full((1 << 20,), 7.0, device=dev) for _ in range(4)]
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        assert all(bool((t == 7.0).all()) for t in others), "a replay wrote into a tensor made after the capture"
        del g, static_y, static_z, y, others
        torch.cuda.synchronize()

    @sub("make_graphed_callables")
    def _():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).to(dev)
        ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).to(dev)
        ref.load_state_dict(model.state_dict())
        x = torch.randn(32, 64, device=dev, requires_grad=True)
        graphed = torch.cuda.make_graphed_callables(model, (x,))
        worst = 0.0
        for _ in range(3):
            # The graphed backward hands out its static gradient buffers, which
            # `.grad` may then alias: gradients are compared step by step, with
            # `.grad` cleared before each step, as PyTorch's docs do.
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            inp = torch.randn(32, 64, device=dev)
            out, want = graphed(inp), ref(inp)
            out.sum().backward()
            want.sum().backward()
            assert torch.allclose(out, want, atol=1e-5), "graphed forward differs from eager"
            # The captured GEMMs may take other cuBLAS algorithms than eager
            # ones: compare relative to the gradients' size.
            worst = max([worst] + [float((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-12))
                                   for a, b in zip(model.parameters(), ref.parameters())])
        assert worst < 1e-3, f"graphed backward differs from eager: relative {worst:.2e}"
        torch.cuda.synchronize()
        return f"relative gradient difference {worst:.2e}"

    @sub("torch_accelerator_memory")
    def _():
        if not hasattr(torch, "accelerator") or not hasattr(torch.accelerator, "memory_allocated"):
            return "torch.accelerator.memory_allocated not present"
        x = torch.empty(8 * MiB, dtype=torch.uint8, device=dev)
        a, c = torch.accelerator.memory_allocated(), torch.cuda.memory_allocated()
        del x
        assert a == c and a >= 8 * MiB, f"accelerator {a} vs cuda {c}"

    @sub("memory_snapshot")
    def _():
        x = torch.empty(MiB, device=dev)
        snap = torch.cuda.memory_snapshot()
        del x
        assert isinstance(snap, list) and len(snap) > 0 and "blocks" in snap[0]
        return len(snap)

    @sub("mem_get_info")
    def _():
        free, total = torch.cuda.mem_get_info()
        assert 0 < free <= total

    @sub("tensor_ops_correct")
    def _():
        a = torch.randn(1000, 1000, device=dev)
        b = torch.randn(1000, 1000, device=dev)
        ref = (a.cpu() @ b.cpu())
        got = (a @ b).cpu()
        assert torch.allclose(ref, got, rtol=1e-3, atol=1e-3)

    @sub("gpus_chosen_after_install")
    def _():
        # As under PyTorch's allocator, a program may still choose its GPUs
        # after installing (Ultralytics' select_device sets
        # CUDA_VISIBLE_DEVICES just before its first CUDA call): installing
        # must not initialize the CUDA driver (Note [Starting on first use]).
        import subprocess
        import textwrap

        code = _installing_child(args.alloc) + textwrap.dedent("""
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
            import torch
            print("AVAILABLE", torch.cuda.is_available(), torch.cuda.device_count())
        """)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
        assert "AVAILABLE False 0" in r.stdout, (r.stdout + r.stderr)[-600:]

    @sub("oom_is_catchable")
    def _():
        # On every route a request that never fits raises an exception that
        # opens with PyTorch's "CUDA out of memory." (what libraries that
        # retry a smaller batch look for), and allocation goes on: through
        # the bridge torch.cuda.OutOfMemoryError; without it (the fallback,
        # the raw route) a RuntimeError thrown by gpualloc_malloc_or_raise
        # (Note [An error PyTorch can catch without the bridge]). In a child
        # process, so that a crash fails this sub-check alone.
        import subprocess
        import textwrap

        code = _installing_child(args.alloc) + textwrap.dedent("""
            import torch
            x = torch.ones(1 << 20, device="cuda")
            for _ in range(2):
                try:
                    torch.empty(4 * torch.cuda.mem_get_info()[1], dtype=torch.uint8, device="cuda")
                    print("NO ERROR")
                except RuntimeError as e:
                    print("RAISED", type(e).__name__, str(e)[:120].replace(chr(10), " "))
            y = torch.ones(1 << 20, device="cuda")
            print("AFTER", float(x.sum() + y.sum()))
        """)
        r = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=180)
        text = (r.stdout + r.stderr)[-900:]
        assert r.returncode == 0, f"rc={r.returncode}: {text}"
        raised = [line for line in r.stdout.splitlines() if line.startswith("RAISED ")]
        assert len(raised) == 2 and all(" CUDA out of memory." in line for line in raised), text
        assert f"AFTER {float(2 << 20)}" in r.stdout, text
        return raised[0][len("RAISED "):]

    passed = sum(1 for v in out.values() if v["ok"])
    return {"passed": passed, "total": len(out), "checks": out}


# ---------------------------------------------------------------------------
# streams: a block freed while its stream still works must not reach another stream


def check_streams(args) -> dict:
    import torch

    dev = torch.device("cuda:0")
    n = 32 * MiB // 4
    cycles = 100_000_000  # about 50 ms of torch.cuda._sleep at H200 clocks
    res = {}

    # 1. Free on stream A while A's kernels are still queued, then allocate on B.
    bad = 0
    for rep in range(5):
        a, b = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(a):
            x = torch.empty(n, device=dev)
            torch.cuda._sleep(cycles)
            x.fill_(1.0)  # runs late, on A
        del x  # freed on the host now; A still has work on it
        with torch.cuda.stream(b):
            y = torch.empty(n, device=dev)
            y.fill_(2.0)
        torch.cuda.synchronize()
        bad += int((y != 2.0).sum())
        del y
    res["free_while_busy_then_other_stream"] = {"ok": bad == 0, "corrupted_elements": bad}

    # 2. record_stream: a side stream still writes the block after the free.
    bad = 0
    for rep in range(5):
        side = torch.cuda.Stream()
        x = torch.zeros(n, device=dev)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
            x.add_(1.0)  # late write on the side stream
        x.record_stream(side)
        del x
        y = torch.empty(n, device=dev)  # default stream, same size
        y.fill_(7.0)
        torch.cuda.synchronize()
        bad += int((y != 7.0).sum())
        del y
    res["record_stream"] = {"ok": bad == 0, "corrupted_elements": bad}

    # 3. Same stream reuse stays correct (ordering within a stream).
    bad = 0
    for rep in range(20):
        x = torch.full((n,), float(rep), device=dev)
        del x
        y = torch.empty(n, device=dev)
        y.fill_(rep + 0.5)
        bad += int((y != rep + 0.5).sum())
    res["same_stream_reuse"] = {"ok": bad == 0, "corrupted_elements": bad}

    # 4. What ColossalAI's Gemini does with prefetched chunks: a block made
    # on a side stream, read on another stream without record_stream and
    # freed while that stream is current, then a request larger than the
    # block (a new live high) on the reading stream or on the block's own.
    # PyTorch never unmaps it; under gpualloc its pages move to the request
    # (defragmentation), and the old address must stay mapped until the
    # queued read is done (Note [Frees on another stream]): an
    # early unmap faults the read (the process dies) or changes its sum.
    n_big = 256 * MiB // 4
    sums, wrong_fill = [], 0
    for rep in range(4):
        side, main = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            x = torch.full((n_big,), 1.0, device=dev)
            z = torch.empty(MiB, dtype=torch.uint8, device=dev)  # keeps x's place from growing
        main.wait_stream(side)
        with torch.cuda.stream(main):
            torch.cuda._sleep(cycles)
            total = x.sum(dtype=torch.float64)  # runs late, on main
            del x  # freed on the host now, main current, no record_stream
        with torch.cuda.stream(main if rep % 2 == 0 else side):
            y = torch.empty(n_big + 16 * MiB, device=dev)
            y.fill_(2.0)
        torch.cuda.synchronize()
        sums.append(float(total))
        wrong_fill += int((y != 2.0).sum())
        del y, z, total
        torch.cuda.empty_cache()
    res["read_elsewhere_then_pages_move"] = {
        "ok": all(v == float(n_big) for v in sums) and wrong_fill == 0,
        "sums": sums,
        "corrupted_elements": wrong_fill,
    }

    # 5. A block freed on its own stream while a late write to it is still
    # queued there, then a request on another stream larger than any free
    # block: under gpualloc the freed pages move to it (defragmentation),
    # the new stream waiting for the old one on the GPU, not the host
    # (Note [Unmapping behind the work]). The late write must land before
    # the new owner's fill, never after it, and the old address must stay
    # mapped until it ran (an early unmap faults it).
    wrong_fill = 0
    for rep in range(4):
        old, new = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(old):
            x = torch.empty(n_big, device=dev)
            z = torch.empty(MiB, dtype=torch.uint8, device=dev)  # keeps x's place from growing
            torch.cuda._sleep(cycles)
            x.fill_(1.0)  # runs late, on the old stream
            del x  # freed on its own stream, the write still queued
        with torch.cuda.stream(new):
            y = torch.empty(n_big + 16 * MiB, device=dev)
            y.fill_(2.0)
        torch.cuda.synchronize()
        wrong_fill += int((y != 2.0).sum())
        del y, z
        torch.cuda.empty_cache()
    res["late_write_then_pages_move_to_another_stream"] = {"ok": wrong_fill == 0, "corrupted_elements": wrong_fill}
    return {"passed": sum(v["ok"] for v in res.values()), "total": len(res), "checks": res}


# ---------------------------------------------------------------------------
# threads: several threads allocating, writing and verifying on their own streams


def check_threads(args) -> dict:
    import torch

    dev = torch.device("cuda:0")
    errors = []
    counts = []

    def worker(tid):
        try:
            rng = random.Random(tid)
            s = torch.cuda.Stream()
            live = []
            n_ok = 0
            with torch.cuda.stream(s):
                for i in range(400):
                    if live and rng.random() < 0.45:
                        t, v = live.pop(rng.randrange(len(live)))
                        if i % 7 == 0 and not bool((t == v).all()):
                            errors.append(f"thread {tid}: tensor lost its value {v}")
                        del t
                    else:
                        numel = rng.choice([128, 4096, 70000, 1 << 20, 3 << 20])
                        v = float(tid * 1000 + i)
                        t = torch.full((numel,), v, device=dev)
                        live.append((t, v))
                    n_ok += 1
                for t, v in live:
                    if not bool((t == v).all()):
                        errors.append(f"thread {tid}: final check failed")
            s.synchronize()
            counts.append(n_ok)
        except Exception as e:  # noqa: BLE001
            errors.append(f"thread {tid}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    t0 = time.time()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    torch.cuda.synchronize()
    return {"ok": not errors, "errors": errors[:10], "ops": sum(counts), "seconds": round(time.time() - t0, 2),
            "allocated_after": torch.cuda.memory_allocated()}


# ---------------------------------------------------------------------------
# multi_device: every visible GPU at once, one thread per device


def check_multi_device(args) -> dict:
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        return {"skipped": f"{n} visible device(s); needs 2", "ok": True}
    errors = []
    per_device = {}

    def worker(d):
        try:
            dev = torch.device(f"cuda:{d}")
            torch.cuda.set_device(dev)
            rng = random.Random(d)
            live = []
            for i in range(600):
                if live and rng.random() < 0.45:
                    t, v = live.pop(rng.randrange(len(live)))
                    if not bool((t == v).all()):
                        errors.append(f"device {d}: a tensor lost its value")
                else:
                    v = float(d * 10000 + i)
                    live.append((torch.full((rng.choice([256, 70000, 1 << 20, 5 << 20]),), v, device=dev), v))
            # Cross-device copies read the other device's memory.
            other = (d + 1) % n
            x = torch.full((1 << 20,), float(d), device=dev)
            y = x.to(f"cuda:{other}")
            if not bool((y == float(d)).all()) or y.device.index != other:
                errors.append(f"device {d}: copy to device {other} is wrong")
            # Copies that are not one memcpy run as a kernel on one device
            # writing (or reading) the other's memory once peer access is
            # on: a transpose, and a change of dtype.
            m = torch.arange(1 << 20, device=dev, dtype=torch.float32).view(1024, 1024)
            if not torch.equal(m.t().to(f"cuda:{other}").cpu(), m.t().cpu()):
                errors.append(f"device {d}: transposed copy to device {other} is wrong")
            h = m.to(torch.bfloat16)
            if not torch.equal(h.to(f"cuda:{other}", torch.float32).cpu(), h.float().cpu()):
                errors.append(f"device {d}: bf16 -> float copy to device {other} is wrong")
            # record_stream on another device's *default* stream, whose
            # handle is this device's default stream's too: while it is busy,
            # the block must not be handed out again.
            with torch.cuda.device(other):
                torch.cuda._sleep(200_000_000)  # about 0.1 s of device `other`'s default stream
            u = torch.empty(4 << 20, device=dev)
            addr = u.data_ptr()
            u.record_stream(torch.cuda.default_stream(other))
            del u
            v = torch.empty(4 << 20, device=dev)
            if v.data_ptr() == addr:
                errors.append(f"device {d}: a block recorded on device {other}'s busy default stream was reused")
            del v
            # record_stream on another device's stream, then the free: later
            # allocations go on, and this thread's device stays its own.
            side = torch.cuda.Stream(device=other)
            t = torch.empty(4 << 20, device=dev)
            t.record_stream(side)
            del t
            for _ in range(50):
                torch.empty(1 << 20, device=dev)
                torch.empty(4 << 20, device=f"cuda:{other}")  # freed here, on this thread
            torch.cuda.empty_cache()  # walks every device
            if torch.cuda.current_device() != d:
                errors.append(f"device {d}: the current device became {torch.cuda.current_device()}")
            torch.cuda.synchronize(dev)
            per_device[d] = {
                "allocated": torch.cuda.memory_allocated(d),
                "reserved": torch.cuda.memory_reserved(d),
                "live_tensors": len(live),
            }
            del live, x, y
        except Exception as e:  # noqa: BLE001
            errors.append(f"device {d}: {type(e).__name__}: {e}")

    ts = [threading.Thread(target=worker, args=(d,)) for d in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    # Each device accounted for its own tensors: live ones while they lived,
    # none once every thread dropped them, and each kept its own cache.
    after = [torch.cuda.memory_allocated(d) for d in range(n)]
    cached = [torch.cuda.memory_reserved(d) for d in range(n)]
    accounted = (len(per_device) == n and all(v["allocated"] > 0 for v in per_device.values())
                 and after == [0] * n and all(c > 0 for c in cached))
    torch.cuda.empty_cache()
    return {"ok": not errors and accounted, "devices": n, "errors": errors[:10],
            "per_device": per_device, "allocated_after": after, "reserved_after": cached,
            "reserved_after_empty_cache": [torch.cuda.memory_reserved(d) for d in range(n)]}


# ---------------------------------------------------------------------------
# training


def _deterministic(seed=0):
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _counters() -> dict:
    """The allocator's counters in torch.cuda.memory_stats(): PyTorch's four
    (None where absent) and every key starting with num_ or driver_ that
    exists; under gpualloc also those of gpualloc.stats() that torch's
    stats lack (the bridge hands torch only PyTorch's fields)."""
    import torch

    stats = torch.cuda.memory_stats()
    out = dict.fromkeys(("num_device_alloc", "num_device_free", "num_sync_all_streams", "num_alloc_retries"))
    out.update((k, v) for k, v in stats.items() if k.startswith(("num_", "driver_")))
    gpualloc = sys.modules.get("gpualloc")
    if gpualloc is not None and gpualloc.installed():
        for k, v in gpualloc.stats().items():
            if k.startswith(("num_", "driver_")):
                out.setdefault(k, v)
    return out


def _device_calls(counters: dict):
    """num_device_alloc + num_device_free, or None where either is absent."""
    a, f = counters.get("num_device_alloc"), counters.get("num_device_free")
    return None if a is None or f is None else a + f


def _train(model, make_batch, loss_fn, steps, lr=0.01):
    """Trains `steps` SGD steps, each timed between two synchronizations.

    median_step_s and mean_step_s leave out the first min(10, 20%) steps;
    mean_step_s_all and wall_s (the whole loop, batches included) do not.
    device_allocs_after_warmup counts num_device_alloc + num_device_free over
    the steps after the first 20%; counters are read at the end. step_ms
    lists every step's time; under gpualloc, step_driver_ms the driver time
    of each step and step_device_calls its device allocations and frees, and
    the driver calls by kind (gpualloc.driver_calls()) made before the loop
    (driver_calls_setup: building the model), in step 0 and in all steps
    (driver_calls_step0, driver_calls), and those the unmapping thread made
    in the whole run, setup included (helper_driver_calls), and those of
    the steps after the first 20% (driver_calls_after_warmup; the
    unmapping thread's calls count in every reading but helper_driver_calls,
    as gpualloc.driver_calls() counts them). host_floor_us
    is the process's host speed before and after the loop (_host_floor_us).
    """
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, times, driver, device = [], [], [], []
    by_kind0 = None
    warmup = steps // 5
    gpualloc = sys.modules.get("gpualloc")
    per_step = gpualloc is not None and gpualloc.installed()
    warm_calls = None
    torch.cuda.reset_peak_memory_stats()
    setup = _driver_calls(gpualloc) if per_step else None
    floor0 = _host_floor_us(torch)
    loop0 = time.perf_counter()
    for step in range(steps):
        if step == warmup:
            before = _counters()
            if per_step:
                warm_calls = _driver_calls(gpualloc)
        batch = make_batch(step)
        torch.cuda.synchronize()
        c0 = gpualloc.stats() if per_step else None
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if per_step:
            c1 = gpualloc.stats()
            driver.append(round((c1["driver_time_ns"] - c0["driver_time_ns"]) / 1e6, 3))
            device.append(sum(c1[k] - c0[k] for k in ("num_device_alloc", "num_device_free")))
            if step == 0:
                by_kind0 = _driver_calls_since(gpualloc, setup)
        losses.append(float(loss.detach()))
        del batch, loss
    wall = time.perf_counter() - loop0
    floor = [floor0, _host_floor_us(torch)]
    after = _counters()
    calls = (_device_calls(before), _device_calls(after))
    warm = times[min(10, len(times) // 5):]
    return {
        "steps": steps,
        "losses": losses,
        "median_step_s": statistics.median(warm),
        "mean_step_s": statistics.fmean(warm),
        "mean_step_s_all": statistics.fmean(times),
        "wall_s": wall,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "peak_reserved_over_allocated": torch.cuda.max_memory_reserved() / max(1, torch.cuda.max_memory_allocated()),
        "num_alloc_retries": after["num_alloc_retries"],
        "counters": after,
        "device_allocs_after_warmup": None if None in calls else calls[1] - calls[0],
        "warmup_steps": warmup,
        "step_ms": [round(t * 1e3, 2) for t in times],
        "host_floor_us": floor,
        **({"step_driver_ms": driver, "step_device_calls": device} if per_step else {}),
        **({"driver_calls_setup": setup, "driver_calls_step0": by_kind0,
            "driver_calls": _driver_calls_since(gpualloc, setup),
            "helper_driver_calls": _driver_calls(gpualloc, helper=True),
            "driver_calls_after_warmup": _driver_calls_since(gpualloc, warm_calls)} if per_step else {}),
    }


def _host_floor_us(torch, n=5000):
    """How fast this process's host runs, in µs per `torch.empty(0)` on the
    GPU (no allocator serves 0 bytes: Python, the dispatcher and the tensor
    only), the best of three loops of `n`. On the H200's virtual machine one
    process reads about 1.4 µs and the next 2.8 µs, whichever CPU it is
    pinned to (`tests/gpu/host_probe.py`, round 37); host-bound steps follow
    it, so runs compared step by step should have read alike."""
    dev = torch.device("cuda:0")
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            torch.empty(0, device=dev)
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return round(best, 3)


def _driver_calls(gpualloc, helper=False):
    """gpualloc's driver calls by kind since the device started (with
    ``helper``, those its unmapping thread made), or None where this build
    of the package cannot tell."""
    f = getattr(gpualloc, "driver_calls", None)
    if f is None:
        return None
    if not helper:
        return f()
    try:
        return f(helper=True)
    except TypeError:  # a build before the unmapping thread
        return None


def _driver_calls_since(gpualloc, before):
    """The driver calls by kind made since the reading ``before`` (kinds
    with no new call left out), or None where either reading is missing."""
    now = _driver_calls(gpualloc)
    if now is None or before is None:
        return None
    out = {}
    for kind, v in now.items():
        b = before.get(kind, {})
        d = {k: v[k] - b.get(k, 0) for k in ("calls", "handles", "bytes", "ms")}
        if d["calls"]:
            out[kind] = d
    return out


class Workload(NamedTuple):
    """A training workload built for one batch size: the model (on the GPU),
    the batch of each step, the loss, the learning rate and a description."""

    model: object
    make_batch: Callable
    loss_fn: Callable
    lr: float
    name: str


def _resnet(batch, steps) -> Workload:
    """torchvision resnet50 on 160x160 synthetic images: one shape throughout."""
    import torch
    import torchvision

    dev = torch.device("cuda:0")
    model = torchvision.models.resnet50(num_classes=100).to(dev)
    g = torch.Generator().manual_seed(1)
    res = 160
    data = [(torch.randn(batch, 3, res, res, generator=g), torch.randint(0, 100, (batch,), generator=g))
            for _ in range(min(8, steps))]

    def make_batch(step):
        x, y = data[step % len(data)]
        return x.to(dev), y.to(dev)

    def loss_fn(m, b):
        return torch.nn.functional.cross_entropy(m(b[0]), b[1])

    return Workload(model, make_batch, loss_fn, 0.05, f"torchvision resnet50, batch {batch}, {res}x{res}, synthetic")


def _gpt2(batch, steps) -> Workload:
    """GPT-2 small (transformers, or TinyGPT without it) on random token sequences of 64..512."""
    import torch

    dev = torch.device("cuda:0")
    vocab = 50257
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12, vocab_size=vocab,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg).to(dev)
        name = "transformers GPT2LMHeadModel from GPT2Config (small, dropout 0)"

        def forward(m, tokens):
            return m(input_ids=tokens, labels=tokens).loss
    except ImportError:
        from models import TinyGPT, next_token_loss

        model = TinyGPT(vocab=vocab, dim=768, layers=12, heads=12).to(dev)
        name = "gpualloc TinyGPT (GPT-2 small shape; transformers not installed)"

        def forward(m, tokens):
            return next_token_loss(m(tokens), tokens)

    rng = random.Random(2)
    g = torch.Generator().manual_seed(2)
    lengths = [rng.randrange(64, 513) for _ in range(steps)]

    def make_batch(step):
        return torch.randint(0, vocab, (batch, lengths[step]), generator=g).to(dev)

    return Workload(model, make_batch, forward, 0.001, name + f", batch {batch}, random lengths 64..512")


def _detection_loss(x, outs):
    """Synthetic targets for dense per-scale outputs: deterministic functions
    of the input (channel 0 against the pooled input, the rest towards 0)."""
    import torch

    loss = 0.0
    for o in outs:
        o = o.float()
        target = torch.nn.functional.adaptive_avg_pool2d(x.mean(1, keepdim=True), o.shape[-2:]).sigmoid()
        loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(o[:, :1], target) + o[:, 1:].pow(2).mean() * 1e-3
    return loss


def _detector(batch, steps) -> Workload:
    """MultiScaleDetector (models.py) on square images of 256..640, a new size drawn each step."""
    import torch

    from models import MultiScaleDetector

    dev = torch.device("cuda:0")
    model = MultiScaleDetector(classes=20).to(dev)
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    sizes = [rng.choice(range(256, 641, 32)) for _ in range(steps)]

    def make_batch(step):
        s = sizes[step]
        return torch.randn(batch, 3, s, s, generator=g).to(dev)

    def loss_fn(m, x):
        return _detection_loss(x, m(x))

    return Workload(model, make_batch, loss_fn, 0.01,
                    f"gpualloc MultiScaleDetector (CSP-like backbone, FPN, 3 heads), batch {batch}, sizes 256..640")


def _backbone(batch, steps) -> Workload:
    """A multi-scale CNN backbone (timm's cspdarknet53, or torchvision's
    resnet50 without timm) with a 1x1 head on each of its last three feature
    maps, in bf16 autocast, on square images of 320..960 (step 32), a new
    size drawn each step; the images are drawn on the GPU."""
    import torch

    from models import FeatureHeads

    dev = torch.device("cuda:0")
    try:
        import timm

        features = timm.create_model("cspdarknet53", pretrained=False, features_only=True)
        channels = features.feature_info.channels()
        name = f"timm {timm.__version__} cspdarknet53 features"
    except ImportError:
        import torchvision
        from torchvision.models.feature_extraction import create_feature_extractor

        features = create_feature_extractor(torchvision.models.resnet50(), {"layer2": "c3", "layer3": "c4", "layer4": "c5"})
        channels = [512, 1024, 2048]
        name = "torchvision resnet50 features (timm not installed)"
    model = FeatureHeads(features, channels).to(dev)
    rng = random.Random(5)
    g = torch.Generator(device=dev).manual_seed(5)
    sizes = [rng.choice(range(320, 961, 32)) for _ in range(steps)]

    def make_batch(step):
        s = sizes[step]
        return torch.randn(batch, 3, s, s, generator=g, device=dev)

    def loss_fn(m, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs = m(x)
        return _detection_loss(x, outs)

    return Workload(model, make_batch, loss_fn, 0.01,
                    name + f" + 1x1 heads on the last 3 levels, bf16 autocast, batch {batch}, sizes 320..960")


# name -> (builder, batch size of train_<name>). The two small ones are the
# same programs on footprints of a few hundred MiB (476 and 356 MiB), where
# the default's headroom (0.5% of the peak) is about one 2 MiB page or less
# (forty-first study in docs/policy-experiments.md): short steps, where the
# driver's time weighs more.
WORKLOADS = {
    "resnet": (_resnet, 128),
    "gpt2": (_gpt2, 8),
    "detector": (_detector, 8),
    "backbone": (_backbone, 32),
    "resnet_small": (_resnet, 4),
    "detector_small": (_detector, 1),
}


def _train_workload(name, steps) -> dict:
    build, batch = WORKLOADS[name]
    _deterministic()
    try:
        w = build(batch, steps)
    except ImportError as e:
        return {"skipped": f"{e.name or e} not installed"}
    out = _train(w.model, w.make_batch, w.loss_fn, steps, lr=w.lr)
    out["model"] = w.name
    return out


def check_train_resnet(args) -> dict:
    return _train_workload("resnet", args.steps or 200)


def check_train_gpt2(args) -> dict:
    return _train_workload("gpt2", args.steps or 200)


def check_train_detector(args) -> dict:
    return _train_workload("detector", args.steps or 200)


def check_train_backbone(args) -> dict:
    return _train_workload("backbone", args.steps or 200)


def check_train_resnet_small(args) -> dict:
    return _train_workload("resnet_small", args.steps or 200)


def check_train_detector_small(args) -> dict:
    return _train_workload("detector_small", args.steps or 200)


# ---------------------------------------------------------------------------
# max_batch: the largest batch that trains under a fixed memory budget

MAX_BATCH_STEPS = 6
MAX_BATCH_CAP = 4096


def check_max_batch(args) -> dict:
    """Caps the process at --budget-gib (set_per_process_memory_fraction) and
    finds the largest batch of --workload that trains MAX_BATCH_STEPS steps
    (with the workload's shape changes) without OutOfMemoryError: doubling
    from 1, then bisection. Every attempt builds its model anew and leaves
    nothing behind (collected, cache emptied, peaks reset) for the next."""
    import gc

    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, args.budget_gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    build = WORKLOADS[args.workload][0]
    attempts = []

    def train(batch):
        _deterministic()
        w = build(batch, MAX_BATCH_STEPS)
        _train(w.model, w.make_batch, w.loss_fn, MAX_BATCH_STEPS, lr=w.lr)
        return w.name

    def fits(batch):
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        attempt = {"batch": batch}
        try:
            attempt["model"] = train(batch)
            attempt["fits"] = True
        except torch.cuda.OutOfMemoryError as e:
            attempt["fits"] = False
            attempt["oom"] = str(e)[:300]
        gc.collect()
        attempt.update(seconds=round(time.perf_counter() - t0, 2), peak_allocated=torch.cuda.max_memory_allocated(),
                       peak_reserved=torch.cuda.max_memory_reserved(), allocated_after=torch.cuda.memory_allocated())
        torch.cuda.empty_cache()
        attempts.append(attempt)
        print(f"max_batch {args.workload}: batch {batch} {'fits' if attempt['fits'] else 'OOM'}", file=sys.stderr, flush=True)
        return attempt["fits"]

    lo, hi, batch = 0, None, 1
    try:
        while hi is None and batch <= MAX_BATCH_CAP:
            if fits(batch):
                lo, batch = batch, batch * 2
            else:
                hi = batch
        while hi is not None and hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
    except ImportError as e:
        return {"skipped": f"{e.name or e} not installed"}
    return {"workload": args.workload, "budget_gib": args.budget_gib, "memory_fraction": fraction,
            "steps": MAX_BATCH_STEPS, "max_batch": lo, "first_oom_batch": hi,
            "model": next((a["model"] for a in reversed(attempts) if a["fits"]), None), "attempts": attempts}


# ---------------------------------------------------------------------------
# churn: torch.empty in a loop, a window of live tensors of mixed sizes


def check_churn(args) -> dict:
    rng = random.Random(4)
    return _churn(args, [rng.choice([256, 4096, 65536, 1 << 20, 5 << 20, 24 << 20]) for _ in range(4096)])


def check_churn_wide(args) -> dict:
    """The issue's churn loop: 64 live tensors of sizes drawn log-uniformly
    from 512 B to 64 MiB, so that no two large sizes repeat exactly."""
    rng = random.Random(5)
    lo, hi = math.log(512), math.log(64 << 20)
    return _churn(args, [int(math.exp(rng.uniform(lo, hi))) for _ in range(4096)])


def _churn(args, sizes) -> dict:
    """torch.empty in a window of 64 live tensors, cycling through `sizes`."""
    import torch

    dev = torch.device("cuda:0")
    window = [None] * 64
    n = args.steps or 200_000
    for i in range(2000):  # warm the cache
        window[i % 64] = torch.empty(sizes[i % 4096], dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        window[i % 64] = torch.empty(sizes[i % 4096], dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    window = None
    peak_reserved, peak_allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
    counters = _counters()
    # The floor: the same loop creating and dropping tensors of 0 bytes, for
    # which no allocator hands out or takes back memory (Python, the
    # dispatcher, the tensor itself). No allocator can make a call of the
    # loop above cheaper than this.
    window = [torch.empty(0, dtype=torch.uint8, device=dev)] * 64
    t0 = time.perf_counter()
    for i in range(n):
        window[i % 64] = torch.empty(0, dtype=torch.uint8, device=dev)
    floor = time.perf_counter() - t0
    return {"ops": n, "seconds": dt, "us_per_alloc_free": dt / n * 1e6, "floor_us_per_call": floor / n * 1e6,
            "peak_reserved": peak_reserved, "peak_allocated": peak_allocated,
            "peak_reserved_over_allocated": peak_reserved / max(1, peak_allocated), "counters": counters}


# ---------------------------------------------------------------------------
# auto_marks: steps and phases recorded without any gpualloc call in the loop


def check_auto_marks(args) -> dict:
    """Trains a tiny model for a few steps, with an eval pass, an
    inference_mode pass and a torch.save in the middle, under
    gpualloc.install(trace=...) (main() sets the path); reads the trace's
    marks and phases back with gpualloc.tracefile and counts them."""
    if args.alloc != "gpualloc":
        return {"skipped": "auto_marks needs --alloc gpualloc"}
    import collections
    import tempfile

    import torch

    import gpualloc
    from gpualloc.tracefile import annotations

    trace = os.environ["GPUALLOC_TEST_TRACE"]
    dev = torch.device("cuda:0")
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = args.steps or 6
    for i in range(steps):
        x, y = torch.randn(64, 256, device=dev), torch.randint(0, 10, (64,), device=dev)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i == steps // 2:
            model.eval()
            with torch.no_grad():
                model(torch.randn(512, 256, device=dev))
            model.train()
            with torch.inference_mode():
                model(x)
            with tempfile.TemporaryDirectory() as d:
                torch.save(model.state_dict(), os.path.join(d, "ckpt.pt"))
    torch.cuda.synchronize()
    stop = gpualloc.trace_stop()
    ann = [a for a in annotations(trace) if a["device"] == 0]
    pushes = collections.Counter(a["name"] for a in ann if a["kind"] == "phase_push")
    pops = collections.Counter(a["name"] for a in ann if a["kind"] == "phase_pop")
    marks = collections.Counter(a["name"] for a in ann if a["kind"] == "mark")
    expected = {"backward": steps, "optimizer": steps, "eval": 2, "checkpoint": 1}
    out = {
        "hooks": gpualloc.auto_marks(),
        "trace": trace,
        "trace_bytes": os.path.getsize(trace),
        "trace_stop": stop,
        "marks": dict(marks),
        "phase_pushes": dict(pushes),
        "phase_pops": dict(pops),
        "expected_pushes": expected,
    }
    out["ok"] = marks.get("step") == steps and dict(pushes) == expected and pushes == pops
    cli = os.environ.get("GPUALLOC_CLI") or os.path.join(HERE, "..", "..", "target", "release", "gpualloc")
    if os.path.isfile(cli):  # optional: what `gpualloc leaks` makes of the marks
        import subprocess

        p = subprocess.run([cli, "leaks", "--json", trace], capture_output=True, text=True, timeout=60)
        try:
            out["cli_leaks_iterations"] = [d.get("iterations") for d in json.loads(p.stdout)["devices"]]
        except (ValueError, KeyError, TypeError):
            out["cli_leaks"] = {"rc": p.returncode, "stdout": p.stdout[-500:], "stderr": p.stderr[-500:]}
    return out


CHECKS = {
    "dropin": check_dropin,
    "streams": check_streams,
    "threads": check_threads,
    "train_resnet": check_train_resnet,
    "train_gpt2": check_train_gpt2,
    "train_detector": check_train_detector,
    "train_backbone": check_train_backbone,
    "train_resnet_small": check_train_resnet_small,
    "train_detector_small": check_train_detector_small,
    "max_batch": check_max_batch,
    "churn": check_churn,
    "churn_wide": check_churn_wide,
    "multi_device": check_multi_device,
    "auto_marks": check_auto_marks,
    "compat": compat.check_compat,
    "ipc": compat.check_ipc,
    "churn_cpp": churn_cpp.check_churn_cpp,
    "trace_cpp": churn_cpp.check_trace_cpp,
    "kernel_speed": kernel_speed.check_kernel_speed,
    "launcher": launcher.check_launcher,
    "promise": promise.check_promise,
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("check", choices=sorted(CHECKS))
    p.add_argument("--alloc", choices=["native", "gpualloc", "raw"], required=True,
                   help="raw: libgpualloc.so as a plain CUDAPluggableAllocator, without the Python package")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gpt2", help="max_batch: what to train")
    p.add_argument("--budget-gib", type=float, default=12.0, help="max_batch: the memory budget")
    args = p.parse_args()
    payload = {"check": args.check}
    if args.check == "auto_marks" and args.alloc == "gpualloc" and not os.environ.get("GPUALLOC_TEST_TRACE"):
        os.environ["GPUALLOC_TEST_TRACE"] = os.path.join(os.environ.get("OUT") or "/tmp", f"auto_marks-{os.getpid()}.gtrace")
    try:
        payload["setup"] = setup(args.alloc)
        payload["result"] = CHECKS[args.check](args)
    except Exception as e:  # noqa: BLE001
        payload["error"] = f"{type(e).__name__}: {e}"
        payload["traceback"] = traceback.format_exc()[-3000:]
    result(payload)


if __name__ == "__main__":
    main()
