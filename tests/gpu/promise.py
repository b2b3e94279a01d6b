"""The promise on the GPU, under a fixed memory budget: a request fails only
when the memory live blocks hold, plus the request, exceeds the budget
(`docs/configuration.md`, "What the default policy promises";
`tests/tests/all/promise_adversarial.rs` checks it on the simulator).

`checks.py promise` caps the process with set_per_process_memory_fraction
and runs seeded random sequences: tensors from 512 B to 512 MiB on two
streams (with record_stream and work still queued), frees in any order,
now and then `empty_cache`. At every probe point it reads the live blocks
from `torch.cuda.memory_snapshot()` and asks for what the bound says is
free:

- the *page bound*: the budget less the 2 MiB pages that hold a byte of a
  live block, exact for gpualloc with `expandable_handle_mb:2`;
- the *handle bound* of the default 16 MiB handles: each live block plus a
  handle on either side (twice as large once `empty_cache` ran, Note
  [Regrowth]), asked for when the page bound's probe failed.

Every probe that is served is filled, then freed, and every live tensor is checked to
still hold its own byte: a mapping that aliased a live page would show.
A request over the budget must raise torch.OutOfMemoryError, and the
process goes on. PyTorch's allocators run the same sequences; how many
page-bound probes each serves is the comparison.

Under a -traced variant the check also replays its own trace with
`gpualloc replay --json` on a device of the GPU's size: the fraction it
set while it ran is in the trace (a `memory_limit` record), so the replay
must fail the same requests and reach the same peaks to the byte.

The pure parts (the bounds, the sequences, the replay's verdict) need no
GPU and are tested in test_scripts.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))

MiB = 1 << 20
PAGE = 2 * MiB
# The budget: 6 GiB and half a page, so that the float product of PyTorch's
# fraction never lands a byte short of a whole number of pages.
BUDGET = 6 * 1024 * MiB + MiB
SEEDS = (1, 2, 3)
OPS = 400
PROBE_EVERY = 25
# Live memory the sequences stay under, as a share of the budget: what
# PyTorch's allocators can serve too, so that all run the same sequence.
LIVE_SHARE = 0.5
# Probes smaller than this are not made (nothing is left to test).
MIN_PROBE = 64 * MiB


def pages_held(blocks, page=PAGE) -> int:
    """Bytes of the distinct `page`-byte pages that hold a byte of one of
    `blocks` ((address, size) pairs)."""
    pages = set()
    for addr, size in blocks:
        if size > 0:
            pages.update(range(addr // page, (addr + size - 1) // page + 1))
    return len(pages) * page


def handles_held(blocks, handle: int) -> int:
    """Bytes that live `blocks` may hold with handles of `handle` bytes
    (mapped whole, on no fixed grid): each block and a handle on either side."""
    return sum(size + 2 * handle for _, size in blocks)


def probe_size(budget: int, held: int, page=PAGE) -> int:
    """The largest whole number of pages that fits in `budget` beside
    `held` bytes (0 when none does)."""
    return max(0, (budget - held) // page * page)


def handle_mb(conf: str) -> int:
    """gpualloc's handle size in MiB under the configuration `conf`
    (GPUALLOC_CONF syntax): `expandable_handle_mb`, 16 by default."""
    m = re.search(r"(?:^|,)\s*expandable_handle_mb\s*:\s*(\d+)", conf or "")
    return int(m[1]) if m else 16


def sequence(seed: int, ops: int = OPS):
    """The seeded operations of one run: ("alloc", size, side_stream),
    ("free", index), ("empty_cache",) and ("probe",); a free's index is
    taken modulo the live tensors at the time."""
    rng = random.Random(seed)
    lo, hi = 9, 29  # 512 B .. 512 MiB, log-uniform
    out = []
    for i in range(ops):
        r = rng.random()
        if r < 0.58:
            out.append(("alloc", int(2 ** rng.uniform(lo, hi)), rng.random() < 0.3))
        elif r < 0.99:
            out.append(("free", rng.randrange(1 << 30)))
        else:
            out.append(("empty_cache",))
        if (i + 1) % PROBE_EVERY == 0:
            out.append(("probe",))
    return out


def _live_blocks(torch):
    """(address, size) of every allocated block, from the snapshot."""
    return [(b["address"], b["size"]) for seg in torch.cuda.memory_snapshot() for b in seg["blocks"]
            if b["state"] == "active_allocated"]


def check_promise(args) -> dict:
    import torch

    dev = torch.device("cuda:0")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(BUDGET / total, 0)
    conf = os.environ.get("GPUALLOC_TEST_CONF", "") if args.alloc == "gpualloc" else None
    handle = handle_mb(conf) * MiB if conf is not None else None
    side = torch.cuda.Stream()
    out = {"budget": BUDGET, "seeds": list(SEEDS), "ops": args.steps or OPS, "handle_mb": handle and handle // MiB,
           "page_probes": 0, "page_served": 0, "handle_probes": 0, "handle_served": 0, "over_probes": 0,
           "over_raised": 0, "alloc_failed": 0, "corrupt": [], "failures": [], "over_served": []}
    t0 = time.time()
    regrown = False  # whether empty_cache ran: handles may be twice as large since
    for seed in SEEDS:
        live = []  # (tensor, byte)
        for n, op in enumerate(sequence(seed, args.steps or OPS)):
            if op[0] == "alloc":
                size, on_side = op[1], op[2]
                if sum(t.numel() for t, _ in live) + size > LIVE_SHARE * BUDGET:
                    continue
                byte = 1 + (n * 7 + seed) % 250
                try:
                    if on_side:
                        with torch.cuda.stream(side):
                            t = torch.empty(size, dtype=torch.uint8, device=dev).fill_(byte)
                        # Used on the default stream too, after the fill (without the
                        # wait, its add_ could write back what the memory held
                        # before); its free then waits for both streams.
                        torch.cuda.current_stream().wait_stream(side)
                        t.record_stream(torch.cuda.current_stream())
                        t.add_(0)
                    else:
                        t = torch.empty(size, dtype=torch.uint8, device=dev).fill_(byte)
                except torch.OutOfMemoryError:
                    out["alloc_failed"] += 1
                    continue
                live.append((t, byte))
            elif op[0] == "free" and live:
                live.pop(op[1] % len(live))
            elif op[0] == "empty_cache":
                torch.cuda.empty_cache()
                regrown = True
            elif op[0] == "probe":
                _probe(torch, dev, out, live, seed, n, handle and handle * (2 if regrown else 1))
        del live
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        regrown = True
    out["seconds"] = round(time.time() - t0, 2)
    out["peak_reserved"] = torch.cuda.max_memory_reserved()
    # PyTorch's allocators promise nothing of the kind (`failures` stays
    # empty for them): the check reads how many probes they serve, and
    # that nothing is corrupt.
    out["ok"] = not out["corrupt"] and not out["failures"] and out["over_raised"] == out["over_probes"]
    trace = os.environ.get("GPUALLOC_TEST_TRACE")
    if args.alloc == "gpualloc" and trace:
        out["replay"] = _replay(torch, trace, total)
        out["ok"] = out["ok"] and out["replay"].get("agrees") is True
    return out


def _replay(torch, trace: str, total: int) -> dict:
    """Stops the trace and replays it on a simulated device of `total`
    bytes under the recorded configuration; compares with the run's own
    counters ([`replay_verdict`])."""
    import gpualloc
    from gpualloc.tracefile import records

    gpualloc.trace_stop()
    s = torch.cuda.memory_stats()
    recorded = {"peak_reserved": s["reserved_bytes.all.peak"], "peak_allocated": s["allocated_bytes.all.peak"],
                "ooms": s["num_ooms"]}
    caps = [r for r in records(trace) if r["kind"] == "memory_limit"]
    cli = os.environ.get("GPUALLOC_CLI") or os.path.join(HERE, "..", "..", "target", "release", "gpualloc")
    try:
        p = subprocess.run([cli, "replay", "--json", "--capacity", str(total), trace],
                           capture_output=True, text=True, timeout=300)
        replayed = json.loads(p.stdout)[0]["devices"][0]
    except (OSError, subprocess.SubprocessError, ValueError, LookupError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:500], "recorded": recorded}
    return replay_verdict(recorded, replayed, caps)


def replay_verdict(recorded: dict, replayed: dict, caps: list) -> dict:
    """Whether a replay agrees with its recording: the same peaks of
    reserved and allocated memory and the same failed requests, from a
    trace that holds the fraction the check set (a `memory_limit` record
    with a fraction below 1)."""
    keys = ("peak_reserved", "peak_allocated", "ooms")
    got = {k: replayed.get(k) for k in keys}
    fractions = [c["fraction"] for c in caps if "fraction" in c]
    return {"recorded": recorded, "replayed": got, "memory_limit_records": len(caps),
            "fraction_recorded": fractions[-1] if fractions else None,
            "agrees": bool(fractions) and fractions[-1] < 1 and all(recorded[k] == got[k] for k in keys)}


def _probe(torch, dev, out, live, seed, n, handle):
    """One probe point: the page bound's request, then (for gpualloc with
    larger handles, when that failed) the handle bound's, then a request
    over the budget; then every live tensor is checked. A probe the
    promise covers and that is not served is listed in `failures`."""
    blocks = _live_blocks(torch)
    size = probe_size(BUDGET, pages_held(blocks))
    if size >= MIN_PROBE:
        out["page_probes"] += 1
        served = _try(torch, dev, size)
        out["page_served"] += served
        if not served and handle:
            miss = {"seed": seed, "op": n, "bound": "page", "size": size, "live_blocks": len(blocks)}
            if handle > PAGE:  # only the handle bound is promised
                size = probe_size(BUDGET, handles_held(blocks, handle))
                miss = None
                if size >= MIN_PROBE:
                    out["handle_probes"] += 1
                    if _try(torch, dev, size):
                        out["handle_served"] += 1
                    else:
                        miss = {"seed": seed, "op": n, "bound": "handle", "size": size, "live_blocks": len(blocks)}
            if miss:
                out["failures"].append(miss)
    # Over the budget: more than all the memory that is not live.
    out["over_probes"] += 1
    over = BUDGET - sum(s for _, s in blocks) + PAGE
    try:
        x = torch.empty(over, dtype=torch.uint8, device=dev)
        out["over_served"].append({"seed": seed, "op": n, "size": over, "live_blocks": len(blocks),
                                   "reserved": torch.cuda.memory_reserved(), "budget": BUDGET})
        del x
    except torch.OutOfMemoryError:
        out["over_raised"] += 1
    for i, (t, byte) in enumerate(live):
        lo, hi = torch.aminmax(t)
        if (int(lo), int(hi)) != (byte, byte):
            out["corrupt"].append({"seed": seed, "op": n, "tensor": i, "bytes": t.numel(),
                                   "want": byte, "min": int(lo), "max": int(hi)})


def _try(torch, dev, size) -> bool:
    """Allocates `size` bytes and fills them, then frees them. Nothing is
    read back while they live: a reduction allocates a small buffer of its
    own, and a probe at the bound leaves no page for it. A mapping that
    aliased a live page shows in the live tensors, checked after."""
    try:
        x = torch.empty(size, dtype=torch.uint8, device=dev)
    except torch.OutOfMemoryError:
        return False
    x.fill_(255)
    del x
    return True


def compare_promise(runs: dict, variants) -> dict:
    """Per variant, from the runs of `driver.py` (keyed "promise/VARIANT"):
    whether it passed, the page-bound probes served (and their share), the
    handle-bound probes served, the over-budget requests refused and the
    corrupt tensors; a run that failed or is missing shows its error."""
    table = {}
    for v in variants:
        run = runs.get(f"promise/{v}", {})
        r = run.get("result")
        if not isinstance(r, dict) or "page_probes" not in r:
            table[v] = {"error": run.get("error") or run.get("skipped") or "did not run"}
            continue
        table[v] = {
            "ok": r.get("ok"),
            "page_served": f"{r['page_served']}/{r['page_probes']}",
            "page_share": round(r["page_served"] / r["page_probes"], 3) if r["page_probes"] else None,
            "handle_served": f"{r['handle_served']}/{r['handle_probes']}",
            "over_refused": f"{r['over_raised']}/{r['over_probes']}",
            "corrupt": len(r["corrupt"]),
            "failures": len(r["failures"]),
            **({"replay_agrees": r["replay"].get("agrees", r["replay"].get("error"))} if "replay" in r else {}),
        }
    return table
