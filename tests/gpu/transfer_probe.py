"""How fast copies between the host and tensors the allocator handed out
run, and what a host-fed training step costs, under one allocator.

    python3 tests/gpu/transfer_probe.py --out DIR [--variants native,native-expandable,gpualloc]
        [--repeats 2] [--rounds 30]

runs each variant (driver.py's names) in its own process, the order
turned each repeat, and writes DIR/transfer.json and a table. One run
(`--child --alloc native|gpualloc`) prints one GPUALLOC_RESULT line: for
4 MiB, 55 MiB (a batch of 96 images of 224x224 in float32) and 512 MiB,
the median milliseconds of 20 copies (7 of 512 MiB) host to device and
back, from pageable and from pinned memory, into a tensor allocated once
(`into`) and with the tensor allocated by the copy (`to`, what
`batch.to("cuda")` does), and of a device-to-device clone; the same after
a warm-up that allocates and frees 400 tensors of random sizes from 1 to
64 MiB (the layout a training run leaves); and the median step of timm's
vit_small_patch16_224 (fp16 autocast, AdamW, batch 96) fed from host
memory as a training loop feeds it, and fed from tensors already on the
GPU."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MiB = 1 << 20
SIZES = {"4MiB": 4 * MiB, "55MiB": 96 * 3 * 224 * 224 * 4, "512MiB": 512 * MiB}


def _median_ms(torch, n, fn):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(out), 4)


def copies(torch):
    dev = torch.device("cuda:0")
    res = {}
    for name, size in SIZES.items():
        reps = 20 if size < 256 * MiB else 7
        n = size // 4
        pageable = torch.rand(n)
        pinned = pageable.pin_memory()
        dst = torch.empty(n, device=dev)
        back = torch.empty(n)
        back_pinned = torch.empty(n).pin_memory()
        res[name] = {
            "h2d_pageable_into": _median_ms(torch, reps, lambda: dst.copy_(pageable)),
            "h2d_pinned_into": _median_ms(torch, reps, lambda: dst.copy_(pinned, non_blocking=True)),
            "h2d_pageable_to": _median_ms(torch, reps, lambda: pageable.to(dev)),
            "h2d_pinned_to": _median_ms(torch, reps, lambda: pinned.to(dev, non_blocking=True)),
            "d2h_pageable": _median_ms(torch, reps, lambda: back.copy_(dst)),
            "d2h_pinned": _median_ms(torch, reps, lambda: back_pinned.copy_(dst, non_blocking=True)),
            "d2d": _median_ms(torch, reps, lambda: dst.clone()),
        }
        del dst
    return res


def fragment(torch):
    rng = random.Random(7)
    live = []
    for _ in range(400):
        live.append(torch.empty(rng.randrange(1, 65) * MiB, dtype=torch.uint8, device="cuda"))
        if len(live) > 24:
            live.pop(rng.randrange(len(live)))
    del live
    torch.cuda.synchronize()


def vit(torch, rounds):
    from sweep import vit_training

    dev = torch.device("cuda:0")
    torch.manual_seed(13)
    step, host = vit_training(dev)
    on_gpu = [(x.to(dev), y.to(dev)) for x, y in host]

    out = {}
    for name, feed in (("from_host", lambda i: [t.to(dev) for t in host[i % 4]]), ("on_gpu", lambda i: on_gpu[i % 4])):
        ms = []
        for i in range(rounds):
            t0 = time.perf_counter()
            step(*feed(i))
            ms.append((time.perf_counter() - t0) * 1e3)
        out[name] = {"median_ms": round(statistics.median(ms[5:]), 3), "round_ms": [round(x, 2) for x in ms]}
    return out


def child(args):
    from checks import result, setup

    info = setup(args.alloc)
    import torch

    torch.cuda.init()
    res = {"setup": info, "fresh": copies(torch)}
    fragment(torch)
    res["fragmented"] = copies(torch)
    res["vit"] = vit(torch, args.rounds)
    res["peak_reserved_over_allocated"] = torch.cuda.max_memory_reserved() / max(1, torch.cuda.max_memory_allocated())
    result(res)


def table(runs):
    """Median over repeats of each variant's figures, one row per figure."""
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    ok = {v: [r for r in runs if r["variant"] == v and "fresh" in r] for v in variants}
    rows = []
    for state in ("fresh", "fragmented"):
        for size in SIZES:
            for kind in ("h2d_pageable_into", "h2d_pinned_into", "h2d_pageable_to", "h2d_pinned_to",
                         "d2h_pageable", "d2h_pinned", "d2d"):
                vals = [statistics.median(r[state][size][kind] for r in ok[v]) if ok[v] else None for v in variants]
                rows.append((f"{state} {size} {kind}", vals))
    for feed in ("from_host", "on_gpu"):
        rows.append((f"vit step, {feed}",
                     [statistics.median(r["vit"][feed]["median_ms"] for r in ok[v]) if ok[v] else None for v in variants]))
    md = ["| ms (median of repeats) | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
    for name, vals in rows:
        md.append(f"| {name} | " + " | ".join("failed" if x is None else f"{x:.3f}" for x in vals) + " |")
    return "\n".join(md)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    ap.add_argument("--variants", default="native,native-expandable,gpualloc")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--alloc")
    args = ap.parse_args()
    if args.child:
        return child(args)
    import driver

    variants = driver.parse_variants(args.variants)
    driver.require_library(variants)
    logdir = os.path.join(args.out, "transfer-logs")
    os.makedirs(logdir, exist_ok=True)
    if any(driver.variant(v)[0] == "gpualloc" for v in variants):
        driver.build_bridge(logdir)
    runs = []
    for rep in range(args.repeats):
        for v in driver.run_order(variants, rep):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--alloc", driver.variant(v)[0],
                   "--rounds", str(args.rounds)]
            r = driver.run_child(cmd, v, 300, logdir, f"transfer-{v}-{rep}")
            r.update(variant=v, repeat=rep)
            print(f"{v} repeat {rep}: {'ok' if 'fresh' in r else r.get('error')} ({r['wall_s']} s)", flush=True)
            runs.append(r)
    md = table(runs)
    note = driver.order_note(variants, args.repeats)
    driver.write_results(args.out, "transfer", md + ("\n\n" + note if note else ""), runs)


if __name__ == "__main__":
    main()
