"""GPU checks of what reaches deep into the allocator (issue: every allocator
feature PyTorch users touch). Run through checks.py like the others:

    python3 tests/gpu/checks.py compat --alloc native|gpualloc
    python3 tests/gpu/checks.py ipc --alloc native|gpualloc

compat: torch.compile(mode="reduce-overhead") for inference and for training
whose batch size changes (cudagraph trees re-record and restore pool
checkpoints), torch.compile(mode="max-autotune") training (kernels
benchmarked on buffers of inductor's own, then CUDA graphs), memory history read back by torch.cuda._memory_viz and
replayed backwards from the snapshot as MemoryViz does (through stitched
memory under gpualloc), MemPool
with use_mem_pool, a MemPool whose allocator frees a tensor from inside
its own call (a Python callback whose garbage collection frees CUDA
memory), memory capable of GPUDirect RDMA where the device supports it
(what libraries registering tensors with network cards need), the
out-of-memory observer, the generic allocator
registry, the raw caching_allocator_alloc/delete API, settings changed
mid-run with torch.cuda.memory._set_allocator_settings, the caching
allocator switched off and on (torch.cuda.memory.caching_allocator_enable),
more than the device asked for while it is off (in a child process),
CUDAAllocator::getExpandableSegmentSizes asked from a C++ extension,
memory history in a child forked before the first CUDA call,
PYTORCH_NO_CUDA_MEMORY_CACHING in a child process, and (gpualloc
only) a cudaMalloc made while switched off that fits only once gpualloc's
cache is given back, and the trace of a multiprocessing worker forked
before CUDA, complete at its os._exit. ipc: a CUDA tensor sent to a child process through
torch.multiprocessing, the child under PyTorch's allocator and under
gpualloc. Each sub-check passes or fails on its own.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import warnings

MiB = 1 << 20
# Objects that must outlive the checks (callbacks an allocator keeps calling).
_KEEP = []


class Subchecks:
    """Runs each decorated function, recording ok/value or the error."""

    def __init__(self):
        self.checks = {}

    def __call__(self, name):
        def deco(fn):
            try:
                v = fn()
                self.checks[name] = {"ok": True, **({"value": v} if v is not None else {})}
            except Exception as e:  # noqa: BLE001 - every failure is reported, not fatal
                self.checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:800]}
            return fn

        return deco

    def result(self):
        return {"checks": self.checks, "passed": sum(v["ok"] for v in self.checks.values()), "total": len(self.checks)}


def _dumped_snapshot(torch):
    """torch.cuda.memory._dump_snapshot written to a file and read back, as
    MemoryViz gets it."""
    path = os.path.join(tempfile.mkdtemp(), "snapshot.pickle")
    torch.cuda.memory._dump_snapshot(path)
    with open(path, "rb") as f:
        return pickle.load(f)


def _stitches(dev):
    """gpualloc's stitches built so far on `dev` (None under PyTorch's
    allocator: torch's memory_stats has no such key)."""
    try:
        import gpualloc
    except ImportError:
        return None
    if not gpualloc.installed():
        return None
    return gpualloc.stats(dev.index or 0).get("num_stitch")


def _replay_backwards(snap, device):
    """MemoryViz's Allocator State History (simulate_memory in
    torch/utils/viz/MemoryViz.js, ported step for step): from the
    snapshot's segments and blocks, undo the device's trace entries newest
    first. Where MemoryViz would throw, this raises AssertionError naming
    the entry: a segment_map undone that no single segment holds, a
    segment_alloc undone that starts no segment, a free_requested undone
    for a block not live, or a live block whose start lies in no segment
    (its draw reads block.segment). Returns the
    number of entries undone."""
    segs = []  # MemoryViz's l_segments, in its own order: dicts addr/size/stream
    blocks = {}  # live blocks: addr -> size
    for seg in snap["segments"]:
        if seg["device"] != device:
            continue
        segs.append({"addr": seg["address"], "size": seg["total_size"], "stream": seg["stream"]})
        addr = seg["address"]
        for b in seg["blocks"]:
            if b["state"] in ("active_allocated", "active_pending_free"):
                blocks[addr] = b["size"]
            addr += b["size"]
    segs.sort(key=lambda x: x["addr"])

    def first_after(addr):
        return next((i for i, e in enumerate(segs) if e["addr"] > addr), -1)

    def map_segment(merge, seg):
        idx = first_after(seg["addr"])
        if not merge:
            segs.insert(idx, seg)  # JavaScript's splice(-1, 0, x) also inserts before the last
            return
        if idx == -1:
            idx = len(segs)
        segs.insert(idx, seg)
        if idx + 1 < len(segs):
            nxt = segs[idx + 1]
            if seg["addr"] + seg["size"] == nxt["addr"] and seg["stream"] == nxt["stream"]:
                seg["size"] += nxt["size"]
                del segs[idx + 1]
        if idx > 0:
            prev = segs[idx - 1]
            if prev["addr"] + prev["size"] == seg["addr"] and prev["stream"] == seg["stream"]:
                prev["size"] += seg["size"]
                del segs[idx]

    def unmap_segment(merge, seg, i):
        if not merge:
            at = next((k for k, x in enumerate(segs) if x["addr"] == seg["addr"]), None)
            assert at is not None, f"entry {i}: undoing segment_alloc {seg['addr']:#x}, which starts no segment"
            del segs[at]
            return
        end = seg["addr"] + seg["size"]
        at = next((k for k, e in enumerate(segs) if e["addr"] <= seg["addr"] and end <= e["addr"] + e["size"]), None)
        assert at is not None, f"entry {i}: undoing segment_map {seg['addr']:#x}+{seg['size']}, which no segment holds"
        ex = segs[at]
        ex_end = ex["addr"] + ex["size"]
        if ex["addr"] == seg["addr"]:
            ex["addr"] += seg["size"]
            ex["size"] -= seg["size"]
            if ex["size"] == 0:
                del segs[at]
        elif ex_end == end:
            ex["size"] -= seg["size"]
        else:
            ex["size"] = seg["addr"] - ex["addr"]
            segs.insert(at + 1, {"addr": end, "size": ex_end - end, "stream": ex["stream"]})

    def check_blocks(i):
        for addr in blocks:
            assert any(x["addr"] <= addr < x["addr"] + x["size"] for x in segs), (
                f"before entry {i}: live block {addr:#x} lies in no segment"
            )

    trace = snap["device_traces"][device]
    check_blocks(len(trace))
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        a = e["action"]
        seg = {"addr": e["addr"], "size": e["size"], "stream": e.get("stream")}
        if a in ("free", "free_completed"):
            blocks[e["addr"]] = e["size"]
        elif a == "free_requested":
            assert e["addr"] in blocks, f"entry {i}: undoing free_requested of {e['addr']:#x}, which is not live"
        elif a == "alloc":
            blocks.pop(e["addr"], None)
        elif a in ("segment_free", "segment_unmap"):
            map_segment(a == "segment_unmap", seg)
        elif a in ("segment_alloc", "segment_map"):
            unmap_segment(a == "segment_map", seg, i)
        check_blocks(i)
    return len(trace)


SEGMENT_SIZES = r"""
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/extension.h>

// (stream, is_small_pool, total_size) of each entry.
std::vector<std::tuple<int64_t, bool, int64_t>> sizes(int64_t device) {
  std::vector<std::tuple<int64_t, bool, int64_t>> out;
  auto* allocator = c10::cuda::CUDACachingAllocator::get();
  for (const auto& s : allocator->getExpandableSegmentSizes(static_cast<c10::DeviceIndex>(device))) {
    out.emplace_back(reinterpret_cast<int64_t>(s.stream), s.is_small_pool, static_cast<int64_t>(s.total_size));
  }
  return out;
}
"""


def _mlp(torch, width=256):
    return torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 10)
    ).cuda()


def _train_beside_eager(torch, eager, compiled_loss, batches, mark_step=False):
    """Trains `eager` (cross entropy, SGD) and a copy of it through
    `compiled_loss(model, x, t)` side by side on `batches` of (x, t),
    asserting each step that the two losses agree; with `mark_step`, each
    step begins with `torch.compiler.cudagraph_mark_step_begin()`. Returns
    the trained copy and the (eager, compiled) loss of each step."""
    import copy

    comp = copy.deepcopy(eager)
    runs = [(m, torch.optim.SGD(m.parameters(), lr=0.01), fn)
            for m, fn in ((eager, lambda m, x, t: torch.nn.functional.cross_entropy(m(x), t)), (comp, compiled_loss))]
    losses = []
    for i, (x, t) in enumerate(batches):
        got = []
        for m, opt, fn in runs:
            opt.zero_grad(set_to_none=True)
            if mark_step:
                torch.compiler.cudagraph_mark_step_begin()
            loss = fn(m, x, t)
            loss.backward()
            opt.step()
            got.append(float(loss))
        assert abs(got[0] - got[1]) <= 1e-3 * max(1.0, abs(got[0])), \
            f"step {i} (batch {len(x)}): eager {got[0]} against compiled {got[1]}"
        losses.append(tuple(got))
    return comp, losses


def _fail_twice_the_device(torch, dev):
    """Asks for twice the device's memory: raises AssertionError unless it
    fails with OutOfMemoryError."""
    _, total = torch.cuda.mem_get_info()
    try:
        torch.empty(total * 2, dtype=torch.uint8, device=dev)
    except torch.cuda.OutOfMemoryError:
        return
    raise AssertionError("no OutOfMemoryError")


def check_compat(args) -> dict:
    import torch

    sub = Subchecks()
    dev = torch.device("cuda:0")

    @sub("compile_reduce_overhead_inference")
    def _():
        torch.manual_seed(0)
        m = _mlp(torch).eval()
        cm = torch.compile(m, mode="reduce-overhead")
        with torch.no_grad():
            for i in range(6):
                x = torch.randn(32, 64, device=dev)
                y, ref = cm(x), m(x)
                assert torch.allclose(y, ref, atol=1e-4, rtol=1e-4), f"iteration {i}: compiled output differs"
        return "6 iterations agree with eager"

    @sub("compile_max_autotune_training")
    def _():
        # mode="max-autotune": inductor benchmarks candidate kernels on
        # buffers of its own (each timing flushes the L2 cache with a 256 MB
        # tensor) and runs the result as CUDA graphs from a private pool.
        import time

        # One layer: each matrix product is tuned separately, and an MLP's
        # eight took 148 s on a cold cache.
        torch.manual_seed(0)
        eager = torch.nn.Linear(64, 10).cuda()
        step = torch.compile(lambda m, x, t: torch.nn.functional.cross_entropy(m(x), t), mode="max-autotune")
        t0 = time.time()
        batches = ((torch.randn(128, 64, device=dev), torch.randint(0, 10, (128,), device=dev)) for _ in range(4))
        comp, _ = _train_beside_eager(torch, eager, step, batches)
        for a, b in zip(eager.parameters(), comp.parameters()):
            assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), "parameters differ after 4 steps"
        return {"compile_and_steps_s": round(time.time() - t0, 1)}

    @sub("compile_reduce_overhead_training_changing_batch")
    def _():
        torch.manual_seed(0)
        step = torch.compile(lambda m, x, t: torch.nn.functional.cross_entropy(m(x), t), mode="reduce-overhead")
        gen = torch.Generator(device=dev).manual_seed(1)
        batches = ((torch.randn(b, 64, device=dev, generator=gen), torch.randint(0, 10, (b,), device=dev, generator=gen))
                   for b in [16, 16, 16, 32, 32, 16, 48, 16, 32, 48, 16, 16])
        _, losses = _train_beside_eager(torch, _mlp(torch), step, batches, mark_step=True)
        return {"steps": len(losses), "last": losses[-1]}

    @sub("profiler_sees_cuda_memory")
    def _():
        # torch.profiler.profile(profile_memory=True): the allocator reports
        # each allocation and free (c10::reportMemoryUsageToProfiler).
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True) as prof:
            a = torch.empty(8 * MiB, dtype=torch.uint8, device=dev)
            b = torch.empty(3 * MiB, dtype=torch.uint8, device=dev)
            del a, b
        mem = [getattr(e, "device_memory_usage", None) or getattr(e, "cuda_memory_usage", 0) for e in prof.key_averages()]
        seen = sum(m for m in mem if m > 0)
        assert seen >= 11 * MiB, f"the profiler saw {seen} bytes of CUDA memory allocated, not the 11 MiB made"
        return {"allocated_seen": seen}

    @sub("memory_history_and_memory_viz")
    def _():
        from torch.cuda import _memory_viz

        torch.cuda.memory._record_memory_history(max_entries=100_000)
        try:
            keep = [torch.empty(n * MiB, dtype=torch.uint8, device=dev) for n in (1, 3, 24)]
            tmp = torch.randn(512, 512, device=dev) @ torch.randn(512, 512, device=dev)
            del tmp
            snap = _dumped_snapshot(torch)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        traces = snap["device_traces"][0]
        actions = {e["action"] for e in traces}
        assert "alloc" in actions and "free_completed" in actions, f"actions recorded: {sorted(actions)}"
        ours = [e for e in traces if e["action"] == "alloc" and any("compat.py" in fr.get("filename", "") for fr in e.get("frames", []))]
        assert ours, "no alloc entry has a Python frame of this file"
        addrs = {t.data_ptr() for t in keep}
        blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
        seen = set()
        for s in snap["segments"]:
            a = s["address"]
            for b in s["blocks"]:
                if a in addrs:
                    seen.add(a)
                    assert b["state"] == "active_allocated", f"block of a live tensor is {b['state']}"
                    assert b.get("frames"), "live block without frames"
                a += b["size"]
        assert seen == addrs, f"live tensors not found as blocks: {addrs - seen}"
        html = _memory_viz.trace_plot(snap)
        assert len(html) > 1000
        seg_html = _memory_viz.segment_plot(snap)
        assert len(seg_html) > 1000
        text = _memory_viz.segsum(snap)
        del keep
        return {"trace_entries": len(traces), "actions": sorted(actions), "blocks": len(blocks), "segsum_chars": len(text)}

    @sub("memory_history_state_context_keeps_live_stacks_only")
    def _():
        # context="state" (PyTorch's RecordContext::STATE): stacks for the
        # blocks alive in the snapshot, none on trace entries, not even on
        # a free's completion, which PyTorch's record_trace drops below
        # "alloc" (its test_memory_plots_free_stack).
        def state_probe_alloc():
            return torch.rand(3, 4, device=dev)

        torch.cuda.memory._record_memory_history(context="state")
        try:
            kept = state_probe_alloc()
            gone = state_probe_alloc()
            del gone
            snap = _dumped_snapshot(torch)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        with_stack = [e["action"] for e in snap["device_traces"][0] if e.get("frames")]
        assert not with_stack, f"trace entries with stacks under context='state': {with_stack}"
        frames = [fr.get("name", "") for seg in snap["segments"] for b in seg["blocks"]
                  if b["state"] == "active_allocated" for fr in b.get("frames", [])]
        assert "state_probe_alloc" in frames, "the live block lost its stack"
        del kept
        return {"trace_entries": len(snap["device_traces"][0])}

    @sub("memory_history_stacks_outlive_recording")
    def _():
        # A block allocated while history records keeps its stack in later
        # snapshots, after recording stops (PyTorch's blocks keep
        # context_when_allocated); a block allocated after it has none,
        # even at the address of a freed block that had one.
        torch.cuda.memory._record_memory_history(max_entries=1000)
        try:
            kept = torch.empty(5 * MiB, dtype=torch.uint8, device=dev)
            gone = torch.empty(7 * MiB, dtype=torch.uint8, device=dev)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        addr = gone.data_ptr()
        del gone
        later = torch.empty(7 * MiB, dtype=torch.uint8, device=dev)
        has_frames = {}
        for s in torch.cuda.memory._snapshot()["segments"]:
            a = s["address"]
            for b in s["blocks"]:
                if b["state"] == "active_allocated":
                    has_frames[a] = bool(b.get("frames"))
                a += b["size"]
        same = later.data_ptr() == addr
        assert has_frames.get(kept.data_ptr()) is True, "the block allocated while recording lost its stack once recording stopped"
        assert has_frames.get(later.data_ptr()) is False, (
            "a block allocated after recording stopped has a stack" + (" (a freed block's, at its address)" if same else ""))
        del kept, later
        return {"later_at_the_freed_address": same}

    @sub("memory_history_free_completes_after_other_streams")
    def _():
        # A block used on another stream (record_stream) and freed: its
        # free_requested comes at the free, its free_completed once that
        # stream's work is done (seen by a later allocation), as PyTorch
        # records them; a block used on its own stream completes at once.
        side = torch.cuda.Stream()
        torch.cuda.memory._record_memory_history(max_entries=10_000)
        try:
            x = torch.zeros(9 * MiB, dtype=torch.uint8, device=dev)
            plain = torch.zeros(5 * MiB, dtype=torch.uint8, device=dev)
            addr, plain_addr = x.data_ptr(), plain.data_ptr()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # about 0.1 s of the side stream
                x.add_(1)
            x.record_stream(side)
            del x, plain
            during = torch.cuda.memory._snapshot()["device_traces"][0]
            side.synchronize()
            later = torch.empty(1, device=dev)
            after = torch.cuda.memory._snapshot()["device_traces"][0]
            del later
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

        def frees(trace, a):
            return [e["action"] for e in trace if e["addr"] == a and e["action"].startswith("free")]

        assert frees(during, addr) == ["free_requested"], f"while the side stream runs: {frees(during, addr)}"
        assert frees(after, addr) == ["free_requested", "free_completed"], f"after it: {frees(after, addr)}"
        assert frees(during, plain_addr) == ["free_requested", "free_completed"], frees(during, plain_addr)
        return "free_completed after the other stream's work"

    @sub("memory_viz_replays_history_through_stitches")
    def _():
        # MemoryViz's Allocator State History replays the trace backwards
        # from the snapshot's segments: every block event must find its
        # segment, which under gpualloc's defaults includes stitched ranges
        # (a large request over scattered free pages) and moved pages.
        before = _stitches(dev)
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        try:
            big, walls = [], []
            for _ in range(8):  # 512 MiB, then a live 2 MiB wall after it
                big.append(torch.empty(512 * MiB, dtype=torch.uint8, device=dev))
                walls.append(torch.empty(2 * MiB, dtype=torch.uint8, device=dev))
            del big  # eight 512 MiB holes between live 2 MiB blocks
            for _ in range(3):
                x = torch.empty(2048 * MiB, dtype=torch.uint8, device=dev)  # stitched, then reused
                x.fill_(1)
                del x
            part = [torch.empty(300 * MiB, dtype=torch.uint8, device=dev) for _ in range(3)]  # takes home runs
            y = torch.empty(1536 * MiB, dtype=torch.uint8, device=dev)
            del part, y
            torch.cuda.synchronize()
            snap = _dumped_snapshot(torch)
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        undone = _replay_backwards(snap, dev.index or 0)
        after = _stitches(dev)
        del walls
        torch.cuda.empty_cache()
        if before is not None:
            assert after > before, f"no stitch was built ({before} -> {after}): the check did not reach stitched memory"
        return {"entries_undone": undone, "stitches": None if before is None else after - before}

    @sub("graph_capture_record_stream_reuse")
    def _():
        # PyTorch's test_graph_capture_reclaim_2_streams and _4_streams
        # (torch's opt-in setting since 2.9, which NVIDIA's Megatron recipes
        # set): a block freed during a capture while other streams used it
        # is reused once the graph joins those streams back, not before;
        # with the setting off, only after the capture.
        def reclaim(streams, on):
            torch.cuda.memory._set_allocator_settings(f"graph_capture_record_stream_reuse:{on}")
            try:
                s = [torch.cuda.Stream() for _ in range(streams)]
                g = torch.cuda.CUDAGraph(keep_graph=True)
                torch.cuda.synchronize()
                with torch.cuda.stream(s[0]):
                    g.capture_begin()
                    data1 = torch.ones(8, device=dev)
                    data1_ptr = data1.data_ptr()
                    sink = torch.zeros(8, device=dev)
                    bufs = []
                    for k, side in enumerate(s[1:], start=2):
                        side.wait_stream(s[0])
                        with torch.cuda.stream(side):
                            bufs.append(torch.add(data1, float(k)))
                            data1.record_stream(side)
                    del data1
                    # All but the last side stream joined: no reuse yet.
                    for side in s[1:-1]:
                        s[0].wait_stream(side)
                    sink.add_(1.0)
                    data2 = torch.empty(8, device=dev)
                    s[0].wait_stream(s[-1])
                    sink.add_(1.0)
                    data3 = torch.empty(8, device=dev)
                    g.capture_end()
                torch.cuda.synchronize()
                g.replay()
                torch.cuda.synchronize()
                got = [b[0].item() for b in bufs]
                assert got == [float(1 + k) for k in range(2, streams + 1)], f"replayed sums {got}"
                return data1_ptr, data2.data_ptr(), data3.data_ptr()
            finally:
                torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:False")

        def shared_pool():
            # PyTorch's test_graph_capture_reclaim_shared_pool (pytorch#175817,
            # after torch 2.11): a block still waiting at its capture's end
            # is freed then, and the next capture into the pool reuses it.
            torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
            try:
                s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
                g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                torch.cuda.synchronize()
                with torch.cuda.stream(s1):
                    g1.capture_begin()
                    data1 = torch.ones(8, device=dev)
                    ptr = data1.data_ptr()
                    s2.wait_stream(s1)
                    with torch.cuda.stream(s2):
                        out2 = torch.add(data1, 2.0)
                        data1.record_stream(s2)
                    del data1
                    s1.wait_stream(s2)
                    g1.capture_end()
                    g2.capture_begin(pool=g1.pool())
                    data2 = torch.empty(8, device=dev)
                    g2.capture_end()
                torch.cuda.synchronize()
                g1.replay()
                g2.replay()
                torch.cuda.synchronize()
                assert out2[0].item() == 3.0, f"replayed sum {out2[0].item()}"
                return ptr == data2.data_ptr()
            finally:
                torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:False")

        out = {}
        reused = shared_pool()
        if args.alloc == "gpualloc":
            assert reused, "a block still waiting when its capture ended was not reused by the next capture into the pool"
        out["shared_pool_reused"] = reused
        for streams in (2, 4):
            d1, d2, d3 = reclaim(streams, True)
            assert d1 != d2, f"{streams} streams: data1's block reused before every stream that used it joined"
            assert d1 == d3, f"{streams} streams: data1's block not reused once they all joined"
            d1, d2, d3 = reclaim(streams, False)
            assert d1 != d2 and d1 != d3, f"{streams} streams, setting off: data1's block reused inside the capture"
            out[f"{streams}_streams"] = "reused after the join, not before; off: not reused"
        return out

    @sub("mempool_use_mem_pool")
    def _():
        base = torch.cuda.memory_allocated()
        pool = torch.cuda.MemPool()
        assert pool.use_count() == 1, f"use_count after creation: {pool.use_count()}"
        with torch.cuda.use_mem_pool(pool):
            x = torch.ones(8 * MiB, dtype=torch.uint8, device=dev)
            inner = pool.use_count()
        y = torch.ones(8 * MiB, dtype=torch.uint8, device=dev)
        after = pool.use_count()
        assert after == 1, f"use_count after the scope: {after} (inside: {inner})"
        segs = torch.cuda.memory.memory_snapshot(mempool_id=pool.id)
        in_pool = lambda p: any(s["address"] <= p < s["address"] + s["total_size"] for s in segs)  # noqa: E731
        assert segs and in_pool(x.data_ptr()), "the tensor made inside use_mem_pool is not in the pool's segments"
        assert not in_pool(y.data_ptr()), "a tensor made outside use_mem_pool is in the pool"
        assert all(tuple(s["segment_pool_id"]) == tuple(pool.id) for s in segs), [s["segment_pool_id"] for s in segs]
        assert float(x.float().sum()) == 8 * MiB
        del x, y
        del pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_allocated() == base, f"allocated {torch.cuda.memory_allocated()} != base {base}"
        return {"use_count_inside": inner}

    @sub("mempool_with_another_allocator")
    def _():
        # torch.cuda.MemPool(allocator=...): the pool's segments come from
        # that allocator (here a CUDAPluggableAllocator built from
        # other_allocator.cu), cached and given back by the caching allocator.
        import ctypes

        lib, so = _other_allocator()
        other = torch.cuda.memory.CUDAPluggableAllocator(so, "other_malloc", "other_free")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        pool = torch.cuda.MemPool(other.allocator())
        with torch.cuda.use_mem_pool(pool):
            a = torch.full((MiB,), 3.0, device=dev)
            b = torch.full((10,), 2.0, device=dev)
            c = torch.full((3 * MiB,), 1.0, device=dev)
            a2 = torch.full((MiB // 2,), 1.0, device=dev)
        d = torch.ones(MiB, device=dev)
        made = lib.other_allocs()
        assert made >= 2, f"the other allocator made {made} allocations"
        for name, ptr in (("a", a.data_ptr()), ("b", b.data_ptr()), ("c", c.data_ptr()), ("a2", a2.data_ptr())):
            assert lib.other_owns(ctypes.c_uint64(ptr)), \
                f"tensor {name}, made in the pool, is not in the other allocator's memory"
        assert not lib.other_owns(ctypes.c_uint64(d.data_ptr())), \
            "a tensor made outside the pool is in the other allocator's memory"
        assert made < 4, f"{made} allocations for 4 tensors: the pool does not cache its segments"
        segs = torch.cuda.memory.memory_snapshot(mempool_id=pool.id)
        seg_bytes = sum(s["total_size"] for s in segs)
        assert segs and seg_bytes == lib.other_live_bytes(), \
            f"the pool's segments ({seg_bytes} bytes) are not the other allocator's ({lib.other_live_bytes()})"
        assert all(tuple(s["segment_pool_id"]) == tuple(pool.id) for s in segs), [s["segment_pool_id"] for s in segs]
        total = float(a.sum() + b.sum() + c.sum() + a2.sum())
        assert total == 3.0 * MiB + 20 + 3 * MiB + MiB // 2, total
        grown = torch.cuda.memory_allocated() - base
        assert grown >= a.nbytes + c.nbytes + d.nbytes, f"memory_allocated grew by {grown}"
        del a, b, c, d, a2
        del pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        left, freed = lib.other_live_bytes(), lib.other_frees()
        assert left == 0 and freed == made, f"{made} made, {freed} given back, {left} bytes left"
        # A tensor outlives its MemPool and the allocator's Python object:
        # the pool keeps the allocator until its segments go back.
        import gc

        other2 = torch.cuda.memory.CUDAPluggableAllocator(so, "other_malloc", "other_free")
        pool2 = torch.cuda.MemPool(other2.allocator())
        with torch.cuda.use_mem_pool(pool2):
            x = torch.full((MiB,), 5.0, device=dev)
        del pool2, other2
        gc.collect()
        assert float(x.sum()) == 5.0 * MiB and lib.other_owns(ctypes.c_uint64(x.data_ptr()))
        made = lib.other_allocs()
        del x
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        left, freed = lib.other_live_bytes(), lib.other_frees()
        assert left == 0 and freed == made, f"after the pool went: {made} made, {freed} given back, {left} bytes left"
        assert torch.cuda.memory_allocated() == base, f"allocated {torch.cuda.memory_allocated()} != base {base}"
        return {"segments": made, "segment_bytes": seg_bytes}

    @sub("graph_capture_into_a_pool_of_another_allocator")
    def _():
        # A CUDA graph captured into such a pool: the other allocator's
        # cudaMalloc runs during the capture (in relaxed capture mode, as
        # PyTorch calls raw_alloc), and the graph replays on its memory.
        import ctypes

        lib, so = _other_allocator()
        other = torch.cuda.memory.CUDAPluggableAllocator(so, "other_malloc", "other_free")
        pool = torch.cuda.MemPool(other.allocator())
        x = torch.arange(3 * MiB, dtype=torch.float32, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                (x * 2 + 1).sum()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool.id):
            y = x * 2 + 1
        made = lib.other_allocs()
        assert made >= 1 and lib.other_owns(ctypes.c_uint64(y.data_ptr())), \
            f"the captured output is not in the other allocator's memory ({made} allocations)"
        x.add_(1)
        g.replay()
        torch.cuda.synchronize()
        want = (torch.arange(3 * MiB, dtype=torch.float32, device=dev) + 1) * 2 + 1
        assert torch.equal(y, want), "the replayed graph computed something else"
        del y, g, pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        left = lib.other_live_bytes()
        assert left == 0, f"{left} bytes of the other allocator left after the graph and pool went"
        return {"segments": made}

    @sub("mempool_allocator_callback_frees_a_tensor")
    def _():
        # A MemPool whose allocator runs Python from its C functions (vLLM's
        # sleep-mode CuMemAllocator calls Python from its malloc and free):
        # Python's garbage collector may run there and free CUDA tensors held
        # in cycles, so the caching allocator is called back from inside its
        # own call to the other allocator. PyTorch's lock is re-entrant and
        # frees such a tensor at once; its memory must not stay allocated.
        import ctypes

        lib, _ = _other_allocator()
        lib.other_malloc.restype = ctypes.c_void_p
        lib.other_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.other_free.restype = None
        lib.other_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        victims, calls = [], []

        def py_malloc(size, device, stream):
            calls.append(size)
            if victims:
                victims.pop()  # the tensor's last reference: freed inside this call
            return lib.other_malloc(size, device, stream)

        def py_free(ptr, size, device, stream):
            lib.other_free(ptr, size, device, stream)

        alloc_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
        free_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
        callbacks = (alloc_t(py_malloc), free_t(py_free))  # alive as long as the allocator
        _KEEP.append(callbacks)
        addr = [ctypes.cast(f, ctypes.c_void_p).value for f in callbacks]
        # What CUDAPluggableAllocator(path, alloc, free) builds from a library's symbols.
        other = torch._C._cuda_customAllocator(addr[0], addr[1])
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        victims.append(torch.ones(8 * MiB, dtype=torch.uint8, device=dev))
        pool = torch.cuda.MemPool(other)
        with torch.cuda.use_mem_pool(pool):
            x = torch.full((MiB,), 2.0, device=dev)  # 4 MiB: the pool takes a segment from py_malloc
        assert calls and not victims, f"the other allocator was called {len(calls)} times; {len(victims)} tensors left"
        grown = torch.cuda.memory_allocated() - base
        assert grown < 8 * MiB, \
            f"memory_allocated grew by {grown} bytes: the 8 MiB tensor freed inside the other allocator's call is still allocated"
        assert float(x.sum()) == 2.0 * MiB
        del x, pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        assert torch.cuda.memory_allocated() == base, f"allocated {torch.cuda.memory_allocated()} != base {base}"
        return {"other_allocator_calls": len(calls), "grown": grown}

    @sub("tensors_are_gpudirect_rdma_capable")
    def _():
        # Libraries register tensors with network cards and storage for
        # GPUDirect RDMA: KV-cache transfer between inference servers (NIXL,
        # Mooncake), NCCL's user buffers over InfiniBand, GPUDirect Storage
        # reads into torch.cuda.caching_allocator_alloc buffers
        # (fastsafetensors). cudaMalloc's memory is RDMA capable where the
        # device supports it, and so are PyTorch's expandable segments
        # (gpuDirectRDMACapable where the device supports it with virtual
        # memory). Asked of the driver for each pointer.
        import ctypes

        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        handle = ctypes.c_int()
        assert cu.cuDeviceGet(ctypes.byref(handle), dev.index or 0) == 0, "cuDeviceGet failed"

        def device_attribute(code):
            v = ctypes.c_int()
            return v.value if cu.cuDeviceGetAttribute(ctypes.byref(v), code, handle) == 0 else None

        # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, ..._WITH_CUDA_VMM_SUPPORTED
        rdma, rdma_vmm = device_attribute(116), device_attribute(110)
        if not rdma or not rdma_vmm:
            return {"skipped": f"the device reports GPUDirect RDMA {rdma}, with virtual memory {rdma_vmm}"}

        def capable(ptr):
            v = ctypes.c_int(-1)
            rc = cu.cuPointerGetAttribute(ctypes.byref(v), 15, ptr)  # ..._IS_GPU_DIRECT_RDMA_CAPABLE
            assert rc == 0, f"cuPointerGetAttribute failed ({rc}) for {ptr:#x}"
            return v.value

        tensors = [torch.empty(n, dtype=torch.uint8, device=dev) for n in (4096, 3 * MiB, 64 * MiB)]
        raw = torch.cuda.caching_allocator_alloc(32 * MiB)
        try:
            seen = {f"tensor_{t.numel()}": capable(t.data_ptr()) for t in tensors}
            seen["caching_allocator_alloc"] = capable(raw)
        finally:
            torch.cuda.caching_allocator_delete(raw)
        del tensors
        refused = [k for k, v in seen.items() if v != 1]
        assert not refused, f"memory not capable of GPUDirect RDMA on a device that supports it: {seen}"
        return seen

    @sub("out_of_memory_observer")
    def _():
        seen = []
        torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
        _fail_twice_the_device(torch, dev)
        assert seen, "the observer was not called"
        assert seen[0][0] == 0, f"observer device: {seen[0]}"
        # Under a memory fraction PyTorch tells the memory allowed
        # (allowed_memory_maximum) and the size it needed from the device.
        _, total = torch.cuda.mem_get_info()
        ask = int(total * 0.75)
        torch.cuda.set_per_process_memory_fraction(0.5)
        try:
            torch.empty(ask, dtype=torch.uint8, device=dev)
            raise AssertionError("no OutOfMemoryError for 3/4 of the device under a fraction of 0.5")
        except torch.cuda.OutOfMemoryError:
            pass
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        last = [int(v) for v in seen[-1]]
        assert abs(last[2] - int(0.5 * total)) <= 2 * MiB, f"the observer's memory allowed {last[2]}, under a fraction of 0.5 of {total}"
        assert last[1] >= ask, f"the observer's size {last[1]} < the {ask} bytes asked"
        return {"args": [int(v) for v in seen[0]], "under_a_fraction": last}

    @sub("memory_history_oom_entry_has_stack")
    def _():
        # The history's out-of-memory entry carries the Python stack of the
        # request that failed, as PyTorch records it (memory_viz shows it).
        torch.cuda.memory._record_memory_history(max_entries=10_000)
        try:
            _fail_twice_the_device(torch, dev)
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        ooms = [e for e in snap["device_traces"][0] if e["action"] == "oom"]
        assert ooms, "no oom entry in the history"
        frames = ooms[-1].get("frames", [])
        assert any("compat.py" in fr.get("filename", "") for fr in frames), f"the oom entry's frames: {frames[:3]}"
        return {"frames": len(frames)}

    @sub("memory_metadata_and_annotations")
    def _():
        torch.cuda.memory._record_memory_history(max_entries=10_000, global_record_annotations=True)
        try:
            torch.cuda.memory._set_memory_metadata("compat-phase")
            assert torch.cuda.memory._get_memory_metadata() == "compat-phase"
            with torch.autograd.profiler.record_function("compat_region"):
                t = torch.empty(MiB, dtype=torch.uint8, device=dev)
            torch.cuda.memory._set_memory_metadata("")
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        entries = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and e["addr"] == t.data_ptr()]
        assert entries, "the allocation is not in the history"
        meta = entries[-1].get("user_metadata")
        assert meta == "compat-phase", f"user_metadata {meta!r}"
        names = [str(a) for a in snap.get("external_annotations", [])]
        assert any("compat_region" in n for n in names), f"annotations: {names[:5]}"
        del t
        return {"annotations": len(names)}

    @sub("mempool_options")
    def _():
        # MemPool(no_split=True): a segment per allocation, each one block.
        # MemPool(use_on_oom=True): under a memory fraction that leaves no
        # room to grow, a request outside the pool takes its free block.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out = {}
        pool = torch.cuda.MemPool(no_split=True)
        with torch.cuda.use_mem_pool(pool):
            a = torch.ones(256, dtype=torch.uint8, device=dev)
            b = torch.ones(256, dtype=torch.uint8, device=dev)
        segs = torch.cuda.memory.memory_snapshot(mempool_id=pool.id)
        blocks = sorted(len(s["blocks"]) for s in segs)
        assert len(segs) == 2 and blocks == [1, 1], f"no_split: {len(segs)} segments, blocks {blocks}"
        out["no_split_segments"] = len(segs)
        del a, b, pool
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        lend = torch.cuda.MemPool(use_on_oom=True)
        with torch.cuda.use_mem_pool(lend):
            x = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
        del x
        torch.cuda.synchronize()
        _, total = torch.cuda.mem_get_info()
        room = torch.cuda.memory_reserved() + 64 * MiB
        torch.cuda.set_per_process_memory_fraction(room / total)
        try:
            y = torch.empty(256 * MiB, dtype=torch.uint8, device=dev)
            y.fill_(1)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        segs = torch.cuda.memory.memory_snapshot(mempool_id=lend.id)
        out["use_on_oom_lent"] = any(s["address"] <= y.data_ptr() < s["address"] + s["total_size"] for s in segs)
        assert out["use_on_oom_lent"], "the request that fits only in the pool's free block did not get it"
        # Checked with the fraction lifted (a sum of uint8 makes an int64 copy).
        assert int(y.sum()) == 256 * MiB
        del y, lend
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return out

    @sub("generic_allocator_registry")
    def _():
        x = torch.empty(16 * MiB, dtype=torch.uint8, device=dev)
        a = torch.accelerator.memory_allocated() if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "memory_allocated") else None
        s = torch.UntypedStorage(4 * MiB, device="cuda")
        assert a is None or a >= 16 * MiB, f"torch.accelerator.memory_allocated() = {a}"
        found = any(seg["address"] <= s.data_ptr() < seg["address"] + seg["total_size"] for seg in torch.cuda.memory_snapshot())
        assert found, "an UntypedStorage made on cuda did not come from the installed allocator"
        del x, s
        return {"accelerator_memory_allocated": a}

    @sub("caching_allocator_alloc_and_delete")
    def _():
        # The raw API some extensions use (torch.cuda.caching_allocator_alloc
        # and _delete): counted in memory_allocated, and on the given stream.
        side = torch.cuda.Stream()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        ptrs = [torch.cuda.caching_allocator_alloc(8 * MiB, device=0, stream=side)]
        try:
            ptrs.append(torch.cuda.caching_allocator_alloc(3 * MiB + 5))
            grown = torch.cuda.memory_allocated() - before
            assert grown >= 11 * MiB + 5, f"memory_allocated grew by {grown}"
            blocks = {b["address"]: seg["stream"] for seg in torch.cuda.memory_snapshot() for b in seg["blocks"]
                      if b["state"] == "active_allocated"}
            assert blocks.get(ptrs[0]) == side.cuda_stream, f"stream of the raw block: {blocks.get(ptrs[0])}"
        finally:
            for p in ptrs:
                torch.cuda.caching_allocator_delete(p)
        assert torch.cuda.memory_allocated() == before, "raw blocks were not freed"
        return {"grown": grown}

    @sub("caching_allocator_delete_of_a_pointer_not_allocated_raises")
    def _():
        # Interop code (CuPy or Triton allocators over caching_allocator_alloc,
        # DGL's raw_delete) that frees twice, or a pointer inside a block, is
        # told so: PyTorch raises "invalid device pointer", and the block
        # stays allocated and is freed once.
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        p = torch.cuda.caching_allocator_alloc(4 * MiB)
        raised = {}
        try:
            torch.cuda.caching_allocator_delete(p + 512)
        except RuntimeError as e:
            raised["inside"] = str(e).splitlines()[0][:160]
        assert torch.cuda.memory_allocated() - before >= 4 * MiB, "a wrong free freed the block"
        torch.cuda.caching_allocator_delete(p)
        assert torch.cuda.memory_allocated() == before, "the block was not freed"
        try:
            torch.cuda.caching_allocator_delete(p)
        except RuntimeError as e:
            raised["twice"] = str(e).splitlines()[0][:160]
        assert set(raised) == {"inside", "twice"}, f"raised only for {sorted(raised)}: {raised}"
        assert all("invalid device pointer" in m for m in raised.values()), raised
        # The allocator still serves and frees afterwards.
        x = torch.ones(MiB, device=dev)
        assert float(x.sum()) == MiB
        return raised

    @sub("caching_allocator_switched_off")
    def _():
        # Programs switch the caching allocator off for a while (loading a
        # model, compute-sanitizer runs): torch.cuda.memory.caching_allocator_enable(False).
        # Allocations then come from cudaMalloc, outside the allocator's
        # stats, under PyTorch's allocator as under gpualloc; what was made
        # while off is freed after switching back on and the reverse, raw
        # blocks (cuDNN workspaces) too, and a cuDNN convolution runs.
        enable = torch.cuda.memory.caching_allocator_enable
        # isEnabled() reaches Python after torch 2.11; the bridge answers it either way.
        asked = getattr(torch._C, "_cuda_cudaCachingAllocator_is_enabled", None)

        def is_enabled():
            return None if asked is None else asked()
        torch.cuda.synchronize()
        kept = torch.full((4 * MiB,), 5, dtype=torch.uint8, device=dev)
        conv = torch.nn.Conv2d(3, 8, 3).to(dev)
        before = torch.cuda.memory_allocated()
        enable(False)
        try:
            assert is_enabled() in (False, None), "isEnabled() after caching_allocator_enable(False)"
            off = torch.full((12 * MiB + 7,), 7, dtype=torch.uint8, device=dev)
            raw = torch.cuda.caching_allocator_alloc(2 * MiB)
            y = conv(torch.randn(2, 3, 64, 64, device=dev))
            torch.cuda.caching_allocator_delete(raw)
            grown_off = torch.cuda.memory_allocated() - before
            assert grown_off == 0, f"memory_allocated grew by {grown_off} while the caching allocator was off"
            del kept  # made while on, freed while off
            off2 = off.clone()
        finally:
            enable(True)
        assert is_enabled() in (True, None), "isEnabled() after caching_allocator_enable(True)"
        assert int(off[-1]) == 7 and int(off2[0]) == 7 and bool(torch.isfinite(y).all())
        del off, off2, y  # made while off, freed while on
        torch.cuda.synchronize()
        on = torch.empty(8 * MiB, dtype=torch.uint8, device=dev)
        grown_on = torch.cuda.memory_allocated() - before
        assert grown_on >= 8 * MiB - 4 * MiB, f"memory_allocated grew by {grown_on} with the allocator on again"
        del on
        switched = getattr(torch.cuda.memory, "caching_allocator_disabled", None)
        if switched is not None:
            with switched():
                assert is_enabled() in (False, None)
                z = torch.ones(1 << 20, device=dev).sum()
            assert is_enabled() in (True, None) and float(z) == float(1 << 20)
        return {"grown_while_off": grown_off, "context_manager": switched is not None, "is_enabled_asked": asked is not None}

    @sub("caching_allocator_switched_off_out_of_memory")
    def _():
        # More than the device, asked for with the caching allocator
        # switched off, never fits: an error, and the process goes on. Under
        # gpualloc it is OutOfMemoryError in PyTorch's words, which libraries
        # that retry a smaller batch look for ("CUDA out of memory."); PyTorch's
        # allocator raises a CUDA error. In a child process: this path once
        # crashed the process under gpualloc (Note [Numbers in the bridge's
        # messages]), and a crash must fail this check alone.
        seen = _child_result(SWITCHED_OFF_OOM, "SWITCHED_OFF_OOM_RESULT", args.alloc)
        assert seen["raised"], "twice the device fitted with the caching allocator off"
        assert seen["after"] == float(1 << 20), f"a tensor made before reads {seen['after']}"
        if args.alloc == "gpualloc":
            assert seen["oom_type"], f"{seen['raised']}, not OutOfMemoryError: {seen['message']}"
            assert seen["message"].startswith("CUDA out of memory. Tried to allocate "), seen["message"]
        return seen

    @sub("memory_history_skip_actions")
    def _():
        # _record_memory_history(skip_actions=...) leaves those actions out
        # of the trace, and a name PyTorch does not know raises its
        # RuntimeError: under gpualloc the bridge parses the names (c10's
        # parser streams an unknown one into its message, the path of Note
        # [Numbers in the bridge's messages]). In a child process, so that
        # a crash fails this check alone.
        import inspect

        if "skip_actions" not in inspect.signature(torch.cuda.memory._record_memory_history).parameters:
            return {"skipped": "this torch's _record_memory_history takes no skip_actions"}
        seen = _child_result(SKIP_ACTIONS, "SKIP_ACTIONS_RESULT", args.alloc)
        assert seen["actions"].count("alloc") >= 1 and "free_requested" not in seen["actions"], seen["actions"]
        assert "free_completed" in seen["actions"], seen["actions"]
        assert seen["unknown"] == "RuntimeError" and "Unknown TraceEntry action: free" in seen["message"], seen
        assert seen["after"] == float(1 << 20), seen
        return seen

    @sub("allocator_settings_at_runtime")
    def _():
        # Libraries switch settings mid-run (torch.cuda.memory._set_allocator_settings,
        # e.g. expandable segments off before sharing memory). gpualloc
        # honours expandable_segments as PyTorch does (Note [PyTorch's
        # expandable_segments switch]): allocations made while it is off
        # are in plain segments (cudaIpcGetMemHandle works on them), those
        # made after it is on again in expandable memory, where the
        # configuration has it; under PyTorch, likewise.
        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
        if setter is None:
            return {"skipped": "no torch.cuda.memory._set_allocator_settings"}
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if args.alloc == "gpualloc":
            was = "False" if "expandable_segments:False" in conf else "True"
        else:
            was = "True" if "expandable_segments:True" in conf else "False"

        def expandable(t):
            p = t.data_ptr()
            return next(s["is_expandable"] for s in torch.cuda.memory_snapshot()
                        if s["address"] <= p < s["address"] + s["total_size"])

        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                setter("expandable_segments:False")
            a = torch.empty(40 * MiB, dtype=torch.uint8, device=dev).fill_(3)
            # The snapshot says so, and its settings string is PyTorch's,
            # which programs save and set back.
            settings = torch.cuda.memory._snapshot()["allocator_settings"]
            assert settings["expandable_segments"] is False, settings
            # max_split_size as the allocator applies it: -1 when unlimited
            # (SIZE_MAX in C++, which PyTorch hands Python as -1), as in
            # memory_stats (torch 2.11 on an H100, both allocators).
            limit = torch.cuda.memory_stats().get("max_split_size", -1)
            assert settings.get("max_split_size") == limit, (limit, settings)
            setter(settings["PYTORCH_CUDA_ALLOC_CONF"] or "expandable_segments:False")
            setter("expandable_segments:True")
            b = torch.empty(40 * MiB, dtype=torch.uint8, device=dev).fill_(4)
            assert int(a[-1]) == 3 and int(b[-1]) == 4
            kinds = {"off": expandable(a), "on": expandable(b)}
            assert not kinds["off"], f"allocated while off, in expandable memory: {kinds}"
            any_expandable = any(s["is_expandable"] for s in torch.cuda.memory_snapshot())
            if args.alloc == "gpualloc" and any_expandable:
                assert kinds["on"], f"allocated while on, in a plain segment: {kinds}"
                assert any("plain segments" in str(w.message) for w in said), [str(w.message) for w in said]
            del a, b
            torch.cuda.empty_cache()
        finally:
            setter(f"expandable_segments:{was}")
        return {"allocated_after": torch.cuda.memory_allocated(), "expandable": kinds}

    @sub("ipc_handle_while_expandable_off")
    def _():
        # What custom all-reduce kernels do (vLLM, SGLang): cudaIpcGetMemHandle
        # on the base of a tensor's allocation and of a CUDA graph's output,
        # with PyTorch's expandable_segments switched off around them. Both
        # must work under either allocator; under gpualloc's expandable
        # memory (switched on) it must fail, as under PyTorch's.
        import ctypes

        setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
        if setter is None:
            return {"skipped": "no torch.cuda.memory._set_allocator_settings"}
        try:
            rt = ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
            drv = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            return {"skipped": f"no CUDA runtime to call: {e}"}

        def ipc_handle(t):
            base = ctypes.c_uint64(0)
            # CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
            assert drv.cuPointerGetAttribute(ctypes.byref(base), 11, ctypes.c_uint64(t.data_ptr())) == 0
            rc = rt.cudaIpcGetMemHandle(ctypes.create_string_buffer(64), ctypes.c_void_p(base.value))
            rt.cudaGetLastError()  # not left for torch's next check
            return rc

        def range_covers(t):
            # What RDMA and storage libraries register a tensor by (UCX's
            # whole-allocation registration, Mooncake's dma-buf, kvikio):
            # cuMemGetAddressRange of its pointer. On memory mapped from
            # several handles it gives one handle's range, so the tensor
            # is covered only in plain memory (or within one handle).
            base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
            rc = drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(t.data_ptr()))
            assert rc == 0, f"cuMemGetAddressRange failed ({rc})"
            return base.value <= t.data_ptr() and t.data_ptr() + t.nbytes <= base.value + size.value

        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if args.alloc == "gpualloc":
            was = "False" if "expandable_segments:False" in conf else "True"
        else:
            was = "True" if "expandable_segments:True" in conf else "False"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                setter("expandable_segments:False")
            t = torch.empty(8 * MiB, dtype=torch.uint8, device=dev)
            static = torch.ones(1 << 20, device=dev)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                static * 2
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = static * 2
            g.replay()
            torch.cuda.synchronize()
            rcs = {"tensor": ipc_handle(t), "graph_output": ipc_handle(out)}
            assert rcs == {"tensor": 0, "graph_output": 0}, rcs
            assert float(out[-1]) == 2.0
            big = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
            rcs["range_covers_while_off"] = range_covers(big)
            assert rcs["range_covers_while_off"], "cuMemGetAddressRange covers part of a tensor made while off"
            del big
            setter("expandable_segments:True")
            u = torch.empty(40 * MiB, dtype=torch.uint8, device=dev)
            expandable = next(s["is_expandable"] for s in torch.cuda.memory_snapshot()
                              if s["address"] <= u.data_ptr() < s["address"] + s["total_size"])
            if expandable:
                rcs["expandable"] = ipc_handle(u)
                assert rcs["expandable"] != 0, rcs
                rcs["range_covers_expandable"] = range_covers(u)  # told, not asserted: depends on handle sizes
            del t, u, out, g
        finally:
            setter(f"expandable_segments:{was}")
        return rcs

    @sub("expandable_segment_sizes")
    def _():
        # CUDAAllocator::getExpandableSegmentSizes (C++ only, torch >= 2.10),
        # which serving code reads after a warm-up to map as much again
        # ahead of time: one entry per expandable segment with the bytes
        # mapped in it, the default stream's left out. Asked of whichever
        # allocator torch has, from a C++ extension; PyTorch's needs
        # expandable segments switched on, gpualloc's has them by default.
        if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 10):
            return {"skipped": f"torch {torch.__version__} has no getExpandableSegmentSizes"}
        import inline_cpp

        sizes = inline_cpp.build("gpualloc_segment_sizes", SEGMENT_SIZES, ["sizes"], opt="-O1").sizes
        setter = torch.cuda.memory._set_allocator_settings
        native = args.alloc != "gpualloc"
        was = "True" if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") else "False"
        if native:
            setter("expandable_segments:True")
        try:
            # Nothing cached that the side stream could take instead of
            # growing its own segment (gpualloc's cross_stream_reuse).
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                big = torch.empty(64 * MiB, dtype=torch.uint8, device=dev)
                small = torch.empty(4096, dtype=torch.uint8, device=dev)
            on_default = torch.empty(8 * MiB, dtype=torch.uint8, device=dev)
            if not any(seg["is_expandable"] for seg in torch.cuda.memory_snapshot()):
                # A configuration without them (policy:pytorch).
                return {"skipped": "no expandable segments in this configuration"}
            got = sizes(0)
            mine = [(small_pool, n) for stream, small_pool, n in got if stream == side.cuda_stream]
            assert all(stream != 0 for stream, _, _ in got), f"the default stream's segments listed: {got}"
            large = [n for small_pool, n in mine if not small_pool]
            small_ = [n for small_pool, n in mine if small_pool]
            assert len(large) == 1 and large[0] >= 64 * MiB, f"the side stream's large segment: {mine}"
            # gpualloc may serve a small request from a free block of a page
            # another stream's live blocks keep mapped; PyTorch never does.
            assert len(small_) <= 1 and (small_ or not native), f"the side stream's small segments: {mine}"
            assert all(n >= 2 * MiB for n in small_), f"the side stream's small segment: {mine}"
            del big, small, on_default
            side.synchronize()
        finally:
            if native:
                setter(f"expandable_segments:{was}")
        return {"side_stream": mine, "entries": len(got)}

    @sub("memory_history_in_a_child_forked_before_cuda")
    def _():
        # A process that installs the allocator and forks before its first
        # CUDA call (Lightning's `ddp_fork`, a `fork` start method): each
        # child starts CUDA itself, and its memory history must see its
        # frees as well as its allocations.
        seen = _child_result(FORK_BEFORE_CUDA, "FORK_RESULT", args.alloc, warnings=True)
        assert seen["actions"] == ["alloc", "free_requested", "free_completed"], \
            f"the child's history of its tensor: {seen['actions']}"
        return seen

    @sub("no_cuda_memory_caching_variable")
    def _():
        # PYTORCH_NO_CUDA_MEMORY_CACHING=1 (compute-sanitizer runs, crash
        # debugging): every allocation goes to cudaMalloc and its free to
        # cudaFree, outside the allocator's stats, for the whole process;
        # caching_allocator_enable(True) does not turn caching back on.
        import json
        import subprocess

        env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
        trace = os.path.join(tempfile.mkdtemp(), "no-caching.gtrace")
        if args.alloc == "gpualloc":
            env["GPUALLOC_TRACE"] = trace
        seen = _child_result(NO_CACHING, "NO_CACHING_RESULT", args.alloc, env)
        assert seen["allocated"] == 0 and seen["reserved"] == 0, f"counted by the allocator: {seen}"
        assert seen["value"] == 7 * (64 << 20) and seen["conv_finite"], f"wrong results: {seen}"
        # Freed memory goes back to the driver at once (cudaFree): what the
        # tensor took comes back, give or take the driver's own rounding.
        assert seen["taken"] >= 64 << 20 and abs(seen["returned"] - seen["taken"]) <= 8 << 20, seen
        cli = os.environ.get("GPUALLOC_CLI") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                                             "target", "release", "gpualloc")
        if args.alloc == "gpualloc" and os.path.isfile(cli):
            # The trace holds no allocation, and `gpualloc summary` says why.
            q = subprocess.run([cli, "summary", "--json", trace], capture_output=True, text=True, timeout=60)
            assert q.returncode == 0, q.stderr[-600:]
            dev = json.loads(q.stdout)["devices"][0]
            assert dev["allocations"] == 0 and dev["caching_off"]["forced_at_ns"] is not None, dev
            seen["summary_caching_off"] = dev["caching_off"]
        return seen

    @sub("memory_fraction_variable")
    def _():
        # PYTORCH_CUDA_ALLOC_CONF=per_process_memory_fraction:x (a process
        # sharing its GPU): PyTorch caps each device at x of its memory from
        # the start; gpualloc reads the same key (Note [PyTorch's settings
        # under gpualloc]). Half the cap fits, more than the cap in all does
        # not, and set_per_process_memory_fraction(1.0) lifts it.
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:False,per_process_memory_fraction:0.05")
        env.pop("PYTORCH_ALLOC_CONF", None)
        return _capped_from_the_start(args.alloc, env)

    @sub("memory_fraction_set_at_run_time")
    def _():
        # torch.cuda.memory._set_allocator_settings("per_process_memory_fraction:x")
        # before CUDA starts (torch 2.10 and later know the key): PyTorch's
        # allocator caps each device from its start, and so does gpualloc
        # (Note [PyTorch's fraction set at run time] in capi/src/global.rs);
        # set again once CUDA runs, it changes nothing under either.
        if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 10):
            return {"skipped": f"torch {torch.__version__} has no per_process_memory_fraction key"}
        env = dict(os.environ, FRACTION_AT_RUN_TIME="expandable_segments:True,per_process_memory_fraction:0.05")
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env.pop("PYTORCH_ALLOC_CONF", None)
        return _capped_from_the_start(args.alloc, env)

    @sub("nccl_register_mem_pool")
    def _():
        # ProcessGroupNCCL.register_mem_pool (one rank): registers the pool's
        # segments sorted by their registration order (torch 2.11 asserts
        # every one is numbered), then each new segment of the pool through
        # the allocator's trace hook, matched by the pool's id;
        # deregister_mem_pool deregisters every segment of the pool and
        # raises for one that NCCL never registered.
        import socket

        import torch.distributed as dist

        if not dist.is_nccl_available():
            return {"skipped": "no NCCL"}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                device_id=dev)
        try:
            backend = dist.group.WORLD._get_backend(dev)
            pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(pool):
                before = torch.ones(1024, device=dev)  # a small segment, there before registering
            backend.register_mem_pool(pool)
            with torch.cuda.use_mem_pool(pool):
                after = torch.ones(16 * MiB, device=dev)  # a large segment, registered by the hook
            segs = torch.cuda.memory.memory_snapshot(mempool_id=pool.id)
            dist.all_reduce(before)
            dist.all_reduce(after)
            torch.cuda.synchronize()
            assert float(before.sum()) == 1024 and float(after[-1]) == 1.0
            backend.deregister_mem_pool(pool)
            del before, after
            torch.cuda.synchronize()
            del pool
        finally:
            dist.destroy_process_group()
        torch.cuda.empty_cache()
        return {"pool_segments": len(segs)}

    if args.alloc == "gpualloc":

        @sub("another_allocator_swapped_in_is_refused_with_a_warning")
        def _():
            # A library that hands PyTorch another allocator (NeMo-Curator's
            # RMM set-up, in every Dask worker) is warned and carries on under
            # gpualloc; torch itself would raise "Can't swap an already
            # initialized allocator", naming neither gpualloc nor a way out.
            import warnings

            from gpualloc._lib import lib

            other = torch.cuda.memory.CUDAPluggableAllocator(lib().path, "gpualloc_malloc", "gpualloc_free")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.memory.change_current_allocator(other)
            said = [str(w.message) for w in caught if "change_current_allocator" in str(w.message)]
            assert said, f"no warning: {[str(w.message) for w in caught]}"
            assert torch.cuda.get_allocator_backend() == "gpualloc", torch.cuda.get_allocator_backend()
            x = torch.ones(MiB, device=dev)
            assert float(x.sum()) == MiB
            return said[0][:120]

        @sub("caching_allocator_switched_off_takes_back_the_cache")
        def _():
            # Switched off, a cudaMalloc that fits only without gpualloc's
            # cached memory gets it back and succeeds (PyTorch's allocator
            # keeps its cache and raises a CUDA error).
            enable = torch.cuda.memory.caching_allocator_enable
            torch.cuda.synchronize()
            free, _ = torch.cuda.mem_get_info()
            cached = int(free * 0.6) // MiB * MiB
            torch.empty(cached, dtype=torch.uint8, device=dev)
            torch.cuda.synchronize()
            reserved = torch.cuda.memory_reserved()
            assert reserved >= cached, f"{reserved} bytes reserved after freeing {cached}"
            free_now, _ = torch.cuda.mem_get_info()
            want = free_now + cached // 2
            import gpualloc
            from gpualloc.tracefile import annotations

            with tempfile.TemporaryDirectory() as d:
                path = os.path.join(d, "switch.gtrace")
                gpualloc.trace_start(path)
                try:
                    enable(False)
                    try:
                        y = torch.empty(want, dtype=torch.uint8, device=dev)
                        y[-1] = 9
                        last = int(y[-1])
                        del y
                    finally:
                        enable(True)
                finally:
                    gpualloc.trace_stop()
                marks = [a["name"] for a in annotations(path)
                         if a["kind"] == "mark" and a["name"].startswith("caching_allocator_enable")]
            assert last == 9
            # The trace says where allocations went missing.
            assert marks == ["caching_allocator_enable(False)", "caching_allocator_enable(True)"], marks
            return {"cached": cached, "allocated_switched_off": want, "reserved_after": torch.cuda.memory_reserved()}

        @sub("install_after_another_backend_is_said")
        def _():
            # PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync chose another
            # allocator for torch: install() replaces it, says so, and
            # gpualloc serves the allocations.
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
            env.pop("PYTORCH_ALLOC_CONF", None)
            seen = _child_result(REPLACED_BACKEND, "REPLACED_RESULT", args.alloc, env, warnings=True)
            assert seen["before"] == "cudaMallocAsync", seen
            assert seen["said"], f"install() said nothing of the allocator it replaced: {seen}"
            return seen

        @sub("trace_of_a_worker_forked_before_cuda_is_complete")
        def _():
            # install(trace="...{pid}...") in a process that forks before its
            # first CUDA call (Lightning's ddp_fork, mp.Process with fork):
            # multiprocessing ends each worker with os._exit, past every exit
            # handler, and the worker's trace must still end with its END
            # block and hold its allocations and frees.
            import json
            import subprocess
            import sys

            with tempfile.TemporaryDirectory() as d:
                p = subprocess.run([sys.executable, "-c", WORKER_TRACE, d], capture_output=True, text=True, timeout=180)
                lines = [x for x in p.stdout.splitlines() if x.startswith("WORKER_RESULT ")]
                assert p.returncode == 0 and lines, f"rc={p.returncode}: {p.stderr[-600:]}"
                seen = json.loads(lines[-1][len("WORKER_RESULT "):])
                assert seen["exitcode"] == 0, f"the worker's exit code: {seen['exitcode']}"
                path = next((os.path.join(d, n) for n in os.listdir(d) if str(seen["pid"]) in n), None)
                assert path, f"no trace named after the worker's pid {seen['pid']}: {os.listdir(d)}"
                from gpualloc import tracefile

                kinds = tracefile.block_kinds(path)
                assert kinds[-1:] == [tracefile.END], f"the worker's trace ends with blocks {kinds[-3:]}, not END"

                recs = tracefile.records(path)
                allocs = sum(r["kind"] == "alloc" for r in recs)
                frees = sum(r["kind"] in ("free", "free_completed") for r in recs)
                assert allocs >= 8 and frees >= 8, f"{allocs} allocs and {frees} frees in the worker's trace"
                return {"blocks": len(kinds), "allocs": allocs, "frees": frees}

    return sub.result()


# The program of install_after_another_backend_is_said (gpualloc only).
REPLACED_BACKEND = r"""
import json, warnings
import torch
import gpualloc
before = torch.cuda.get_allocator_backend()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gpualloc.install()
x = torch.ones(1 << 20, device="cuda")
said = [str(w.message)[:160] for w in caught if "replaces the" in str(w.message)]
out = {"backend": torch.cuda.get_allocator_backend(), "before": before, "said": said, "sum": float(x.sum())}
print("REPLACED_RESULT " + json.dumps(out), flush=True)
"""


# The program of trace_of_a_worker_forked_before_cuda_is_complete: argv[1]
# is the folder of the traces; prints WORKER_RESULT with the worker's pid
# and exit code.
WORKER_TRACE = r"""
import json, os, sys
import multiprocessing as mp
import torch
import gpualloc

def worker():
    for i in range(8):
        x = torch.empty((i + 1) << 20, dtype=torch.uint8, device="cuda")
        del x
    torch.cuda.synchronize()

if __name__ == "__main__":
    gpualloc.install(trace=os.path.join(sys.argv[1], "run-{pid}.gtrace"))
    assert not torch.cuda.is_initialized()
    p = mp.get_context("fork").Process(target=worker)
    p.start()
    p.join()
    print("WORKER_RESULT " + json.dumps({"pid": p.pid, "exitcode": p.exitcode}), flush=True)
"""


def _other_allocator():
    """other_allocator.cu built with nvcc into a temporary folder, loaded:
    (the ctypes library, its path)."""
    import ctypes
    import shutil
    import subprocess

    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = shutil.which("nvcc") or (CUDA_HOME and os.path.join(CUDA_HOME, "bin", "nvcc"))
    assert nvcc and os.path.exists(nvcc), "no nvcc to build the other allocator"
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "other_allocator.cu")
    so = os.path.join(tempfile.mkdtemp(prefix="gpualloc-other-"), "libother_allocator.so")
    p = subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-o", so, src], capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, f"nvcc: {p.stderr[-600:]}"
    lib = ctypes.CDLL(so)
    lib.other_owns.argtypes = [ctypes.c_uint64]
    for f in ("other_allocs", "other_frees", "other_live_bytes"):
        getattr(lib, f).restype = ctypes.c_long
    return lib, so


# The program of memory_history_in_a_child_forked_before_cuda: argv[1] is
# the allocator; prints FORK_RESULT and the child's findings as JSON.
FORK_BEFORE_CUDA = r"""
import json, os, sys
import torch
if sys.argv[1] == "gpualloc":
    import gpualloc
    gpualloc.install(config=os.environ.get("GPUALLOC_TEST_CONF") or None)
assert not torch.cuda.is_initialized()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    try:
        torch.cuda.memory._record_memory_history(max_entries=1000)
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        addr = x.data_ptr()
        del x
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        actions = [e["action"] for e in snap["device_traces"][0] if e["addr"] == addr and not e["action"].startswith("segment")]
        out = {"actions": actions, "backend": torch.cuda.get_allocator_backend()}
    except Exception as e:
        out = {"error": repr(e)}
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
data = b""
while True:
    chunk = os.read(r, 65536)
    if not chunk:
        break
    data += chunk
_, status = os.waitpid(pid, 0)
print("FORK_RESULT " + data.decode(), flush=True)
sys.exit(0 if status == 0 else 1)
"""


NO_CACHING = r"""
import json, os, sys
import torch
if sys.argv[1] == "gpualloc":
    import gpualloc
    gpualloc.install(config=os.environ.get("GPUALLOC_TEST_CONF") or None)
torch.cuda.init()
torch.cuda.memory.caching_allocator_enable(True)  # no effect under the variable
# Kernels and cuDNN load lazily and take device memory when first used:
# first use them, then count what a tensor takes and gives back.
y = torch.nn.Conv2d(3, 8, 3).cuda()(torch.randn(2, 3, 32, 32, device="cuda"))
int(torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda").sum())
torch.cuda.synchronize()
free0, _ = torch.cuda.mem_get_info()
x = torch.full((64 << 20,), 7, dtype=torch.uint8, device="cuda")
value = int(x.sum())
torch.cuda.synchronize()
free1, _ = torch.cuda.mem_get_info()
out = {"backend": torch.cuda.get_allocator_backend(), "allocated": torch.cuda.memory_allocated(),
       "reserved": torch.cuda.memory_reserved(), "value": value, "conv_finite": bool(torch.isfinite(y).all())}
del x
torch.cuda.synchronize()
free2, _ = torch.cuda.mem_get_info()
out.update(taken=free0 - free1, returned=free2 - free1)
print("NO_CACHING_RESULT " + json.dumps(out), flush=True)
"""


def _child_result(code, marker, alloc, env=None, warnings=False):
    """Runs `code` in a child process with the allocator's name `alloc` as
    its argument and `env` (Python's warnings off unless `warnings`); the
    JSON it printed after `marker`, once the child is checked to have
    allocated through that allocator."""
    import json
    import subprocess
    import sys

    flags = [] if warnings else ["-W", "ignore"]
    p = subprocess.run([sys.executable, *flags, "-c", code, alloc], capture_output=True, text=True, timeout=180,
                       env=env)
    lines = [x for x in p.stdout.splitlines() if x.startswith(marker + " ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}: {p.stderr[-600:]}"
    seen = json.loads(lines[-1][len(marker) + 1:])
    assert "error" not in seen, seen["error"]
    want = "gpualloc" if alloc == "gpualloc" else "native"
    assert seen["backend"] == want, f"the child allocated through {seen['backend']}, not {want}"
    return seen


def _capped_from_the_start(alloc, env):
    """FRACTION_VARIABLE under `alloc` and `env`, which cap the device at
    5% from its start: half the cap fits, more than the cap in all does
    not, and set_per_process_memory_fraction(1.0) lifts it."""
    seen = _child_result(FRACTION_VARIABLE, "FRACTION_RESULT", alloc, env)
    assert seen["half_fits"], seen
    assert seen["over_refused"], f"more than the cap was served: {seen}"
    assert seen["lifted_fits"], seen
    if seen["fraction_at_start"] is not None:  # torch.cuda.get_per_process_memory_fraction, where torch has it
        assert abs(seen["fraction_at_start"] - 0.05) < 1e-9, seen
    return seen


SKIP_ACTIONS = r"""
import json, sys
import torch
if sys.argv[1] == "gpualloc":
    import gpualloc
    gpualloc.install()
x = torch.ones(1 << 20, device="cuda")
out = {"backend": torch.cuda.get_allocator_backend()}
torch.cuda.memory._record_memory_history(max_entries=1000, skip_actions=["free_requested"])
y = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
ptr = y.data_ptr()
del y
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
out["actions"] = sorted({e["action"] for t in snap["device_traces"] for e in t if e["addr"] == ptr})
try:
    torch.cuda.memory._record_memory_history(max_entries=1000, skip_actions=["free"])
    out["unknown"] = None
    torch.cuda.memory._record_memory_history(enabled=None)
except Exception as e:
    out["unknown"] = type(e).__name__
    out["message"] = str(e)[:300]
out["after"] = float(x.sum())
print("SKIP_ACTIONS_RESULT " + json.dumps(out))
"""


SWITCHED_OFF_OOM = r"""
import json, sys
import torch
if sys.argv[1] == "gpualloc":
    import gpualloc
    gpualloc.install()
x = torch.ones(1 << 20, device="cuda")
out = {"backend": torch.cuda.get_allocator_backend()}
torch.cuda.memory.caching_allocator_enable(False)
try:
    torch.empty(2 * torch.cuda.mem_get_info()[1], dtype=torch.uint8, device="cuda")
    out["raised"] = None
except Exception as e:
    out["raised"] = type(e).__name__
    out["oom_type"] = isinstance(e, torch.cuda.OutOfMemoryError)
    out["message"] = str(e)[:300]
finally:
    torch.cuda.memory.caching_allocator_enable(True)
out["after"] = float(x.sum())
print("SWITCHED_OFF_OOM_RESULT " + json.dumps(out))
"""


FRACTION_VARIABLE = r"""
import json, os, sys
import torch
if sys.argv[1] == "gpualloc":
    import gpualloc
    gpualloc.install(config=os.environ.get("GPUALLOC_TEST_CONF") or None)
if os.environ.get("FRACTION_AT_RUN_TIME"):
    torch.cuda.memory._set_allocator_settings(os.environ["FRACTION_AT_RUN_TIME"])
torch.cuda.init()
get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
fraction_at_start = get_fraction() if get_fraction else None
if os.environ.get("FRACTION_AT_RUN_TIME"):
    # Set once CUDA runs: no effect under PyTorch's allocator, nor gpualloc.
    torch.cuda.memory._set_allocator_settings("per_process_memory_fraction:0.5")
cap = int(0.05 * torch.cuda.get_device_properties(0).total_memory)
half = torch.empty(cap // 2, dtype=torch.uint8, device="cuda")
out = {"backend": torch.cuda.get_allocator_backend(), "cap": cap, "half_fits": True, "fraction_at_start": fraction_at_start}
if get_fraction:
    out["fraction_after_late_string"] = get_fraction()
try:
    more = torch.empty(cap * 7 // 10, dtype=torch.uint8, device="cuda")
    out["over_refused"] = False
    del more
except torch.OutOfMemoryError as e:
    out["over_refused"] = True
    out["message"] = str(e)[:300]
torch.cuda.set_per_process_memory_fraction(1.0)
more = torch.empty(cap * 7 // 10, dtype=torch.uint8, device="cuda")
out["lifted_fits"] = True
out["reserved"] = torch.cuda.memory_reserved()
print("FRACTION_RESULT " + json.dumps(out), flush=True)
"""


# ---------------------------------------------------------------------------
# ipc


# Tensors sent: (name, elements, offset in their storage). Small ones
# share a page with their neighbours, large ones span many handles, and a
# view starts inside its storage.
IPC_TENSORS = [("small", 1000, 0), ("4MiB", 1 << 20, 0), ("100MiB", 25 << 20, 0), ("view", 3 << 20, 12345)]


def _ipc_expected(n):
    import torch

    return torch.arange(n, dtype=torch.float32)


def _ipc_child(q, done, receiver):
    if receiver == "gpualloc":
        import gpualloc

        gpualloc.install()
    import torch

    try:
        got = q.get(timeout=60)
        bad = []
        for (name, n, off), t in zip(IPC_TENSORS, got):
            if not torch.equal(t.cpu(), _ipc_expected(n + off)[off:]):
                bad.append(name)
            t.mul_(2)  # the sender sees it: shared memory, not a copy
        torch.cuda.synchronize()
        done.put(("ok" if not bad else f"wrong values in {bad}", torch.cuda.get_allocator_backend()))
        # Keep the tensors until the sender has checked the writes.
        q.get(timeout=60)
        del got
    except Exception as e:  # noqa: BLE001
        done.put((f"{type(e).__name__}: {e}"[:800], None))


def _ipc_release_child(q, done):
    import torch

    try:
        t = q.get(timeout=60)[0]
        done.put(("got", int(t[0])))
        q.get(timeout=60)  # "release"
        del t
        torch.cuda.synchronize()
        done.put(("released", None))
        q.get(timeout=60)  # "done"
    except Exception as e:  # noqa: BLE001
        done.put((f"{type(e).__name__}: {e}"[:800], None))


def check_ipc(args) -> dict:
    import torch
    import torch.multiprocessing as mp

    sub = Subchecks()
    ctx = mp.get_context("spawn")
    for receiver in ("native", "gpualloc"):

        @sub(f"send_to_{receiver}_receiver")
        def _(receiver=receiver):
            q, done = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=_ipc_child, args=(q, done, receiver))
            p.start()
            try:
                xs, formats = [], []
                for name, n, off in IPC_TENSORS:
                    base = torch.arange(n + off, dtype=torch.float32, device="cuda")[off:]
                    # Share now, in this thread: Queue.put pickles in a
                    # feeder thread, where a failure would only be printed.
                    handle = base.untyped_storage()._share_cuda_()[1]
                    formats.append(chr(handle[1]) if len(handle) > 1 else "?")
                    xs.append(base)
                q.put(xs)
                status, backend = done.get(timeout=120)
                assert status == "ok", f"child: {status}"
                torch.cuda.synchronize()
                for (name, n, off), x in zip(IPC_TENSORS, xs):
                    want = 2 * _ipc_expected(n + off)[off:]
                    assert torch.equal(x.cpu(), want), f"{name}: the child's writes are not visible"
                q.put("done")
                return {"child_backend": backend, "formats": "".join(formats)}
            finally:
                p.join(60)
                if p.is_alive():
                    p.kill()

    @sub("a_tensor_let_go_of_is_collected_on_a_miss")
    def _():
        # A tensor freed here while the receiver still holds it waits in
        # torch's limbo; once the receiver lets go, PyTorch's allocator
        # collects it (torch's free-memory callbacks) on the next request
        # that finds no cached block, instead of growing.
        torch.cuda.empty_cache()
        q, done = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_ipc_release_child, args=(q, done))
        p.start()
        try:
            x = torch.ones(64 * MiB, dtype=torch.uint8, device="cuda")
            q.put([x])
            status, _ = done.get(timeout=120)
            assert status == "got", f"child: {status}"
            del x  # the child holds it still
            q.put("release")
            status, _ = done.get(timeout=120)
            assert status == "released", f"child: {status}"
            torch.cuda.synchronize()
            before = torch.cuda.memory_reserved()
            y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
            grew = torch.cuda.memory_reserved() - before
            del y
            q.put("done")
            assert grew == 0, f"reserved memory grew by {grew} bytes: the tensor let go of was not collected on the miss"
            return {"reserved_before": before}
        finally:
            p.join(60)
            if p.is_alive():
                p.kill()

    return sub.result()
