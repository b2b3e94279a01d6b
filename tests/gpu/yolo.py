"""A real third-party training library end to end: Ultralytics YOLO, trained
with multi-scale on synthetic images, under PyTorch's allocator (native,
native-expandable) and under gpualloc, each variant in its own process.

    python3 tests/gpu/yolo.py --out DIR [--epochs 3] [--batch 32] [--images 512]
        [--variants native,native-expandable,gpualloc] [--repeats 1]

A variant ending in "-traced" (gpualloc-traced) records a trace to
DIR/traces/yolo-REPEAT.gtrace, for `gpualloc replay`.

Ultralytics comes from the package registry; nothing is downloaded at run
time (YOLO_OFFLINE, a local font, a model built from its YAML, plots off).
On a machine without network, install the wheels first (see
tests/gpu/yolo.sh). Writes DIR/yolo.json and DIR/yolo.md: per variant, the
time of each epoch (training and validation), peak reserved over peak
allocated, the final losses, and each epoch's device allocations and
(gpualloc's) driver time; then gpualloc's time of each epoch and of the
whole run over the faster PyTorch mode's, per repeat, with the 95%
interval over repeats and whether "epoch times <= PyTorch expandable's"
is met (two repeats or more; the order of the variants turns each repeat).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench  # noqa: E402
import driver  # noqa: E402

CHILD_TIMEOUT_S = 600
COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_driver_calls", "driver_time_ns",
            "num_defragment", "num_stitch")
OURS = "gpualloc"


def epoch_counters(before, after):
    """What one epoch added to the counters: device allocations (PyTorch's
    and gpualloc's), and driver time in ms (gpualloc's only; None under
    PyTorch, which does not count it). A counter missing before and present
    after started at zero (PyTorch lists none before its first allocation)."""
    def added(key):
        a = after.get(key)
        return None if a is None else a - (before.get(key) or 0)

    ns = added("driver_time_ns")
    return {"device_allocs": added("num_device_alloc"), "driver_ms": None if ns is None else ns / 1e6}


def stand_in_polars():
    """Ultralytics imports polars only to read results.csv into each saved
    checkpoint's metadata, inside a try that falls back to an empty dict.
    Where polars is not installed (its wheel is larger than what a run may
    carry to an offline GPU machine), a stand-in module whose read_csv
    raises takes that fallback; every variant gets the same stand-in, and
    the training itself never touches it. Any other use of it fails
    loudly (AttributeError), not silently."""
    try:
        import polars  # noqa: F401
    except ImportError:
        import types

        def read_csv(*_args, **_kwargs):
            raise RuntimeError("polars is not installed (stand-in)")

        sys.modules["polars"] = types.SimpleNamespace(__name__="polars", read_csv=read_csv)
        print("yolo: polars is not installed; results.csv is left out of the checkpoints", file=sys.stderr)


def make_dataset(root, images, size=320, seed=0):
    """Synthetic detection data: noise with filled rectangles of 3 classes,
    labels in YOLO format; the first eighth is also the validation set."""
    import numpy as np
    import cv2

    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    for split in ("train", "val"):
        os.makedirs(os.path.join(root, "images", split), exist_ok=True)
        os.makedirs(os.path.join(root, "labels", split), exist_ok=True)
    for i in range(images):
        img = (nrng.random((size, size, 3)) * 60).astype(np.uint8)
        lines = []
        for _ in range(rng.randint(1, 6)):
            c = rng.randrange(3)
            w, h = rng.randint(16, size // 2), rng.randint(16, size // 2)
            x, y = rng.randint(0, size - w), rng.randint(0, size - h)
            color = [(220, 40, 40), (40, 220, 40), (40, 40, 220)][c]
            cv2.rectangle(img, (x, y), (x + w, y + h), color, -1)
            lines.append(f"{c} {(x + w / 2) / size:.6f} {(y + h / 2) / size:.6f} {w / size:.6f} {h / size:.6f}")
        splits = ["train"] + (["val"] if i < max(8, images // 8) else [])
        for split in splits:
            cv2.imwrite(os.path.join(root, "images", split, f"{i:05d}.jpg"), img)
            with open(os.path.join(root, "labels", split, f"{i:05d}.txt"), "w") as f:
                f.write("\n".join(lines) + "\n")
    yaml = os.path.join(root, "data.yaml")
    with open(yaml, "w") as f:
        f.write(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n  0: red\n  1: green\n  2: blue\n")
    return yaml


def child(args):
    """One training run in this process, under the allocator of --alloc."""
    import torch

    if args.alloc == "gpualloc":
        import gpualloc

        gpualloc.install(config=os.environ.get("GPUALLOC_TEST_CONF") or None,
                         trace=os.environ.get("GPUALLOC_TEST_TRACE") or None)
    stand_in_polars()
    from ultralytics import YOLO

    epochs, marks = [], {}

    def on(name):
        return lambda trainer: marks.setdefault(name, []).append(time.perf_counter())

    train_losses = []

    def epoch_losses(trainer):
        t = getattr(trainer, "tloss", None)  # a dict of tensors, or one tensor
        if isinstance(t, dict):
            train_losses.append({k: round(float(v), 5) for k, v in t.items()})
        elif hasattr(t, "reshape"):
            train_losses.append({str(i): round(float(x), 5) for i, x in enumerate(t.reshape(-1).tolist())})

    def counters():
        stats = torch.cuda.memory_stats()
        if args.alloc == "gpualloc":
            stats.update(gpualloc.stats())  # the driver counters are gpualloc's own
        return {k: stats.get(k) for k in COUNTERS}

    at_fit_end = []
    model = YOLO(args.model)
    for event in ("on_train_epoch_start", "on_train_epoch_end", "on_fit_epoch_end"):
        model.add_callback(event, on(event))
    model.add_callback("on_fit_epoch_end", lambda trainer: at_fit_end.append(counters()))
    model.add_callback("on_train_epoch_end", epoch_losses)
    t0 = time.perf_counter()
    before = counters()
    model.train(data=args.data, epochs=args.epochs, batch=args.batch, imgsz=args.imgsz, multi_scale=0.5,
                workers=4, device=0, seed=0, deterministic=True, plots=False, amp=True, val=True,
                project=args.project, name=args.name, exist_ok=True, verbose=False, close_mosaic=0)
    total = time.perf_counter() - t0
    starts, ends, fits = (marks.get(k, []) for k in ("on_train_epoch_start", "on_train_epoch_end", "on_fit_epoch_end"))
    for s, e, f, c in zip(starts, ends, fits, at_fit_end):
        epochs.append({"train_s": e - s, "epoch_s": f - s, **epoch_counters(before, c)})
        before = c
    losses = train_losses[-1] if train_losses else None
    out = {
        "epochs": epochs,
        "total_s": total,
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "final_losses": losses,
        "train_losses": train_losses,
    }
    out["peak_reserved_over_allocated"] = out["peak_reserved"] / max(1, out["peak_allocated"])
    out["counters"] = counters()
    print("GPUALLOC_RESULT " + json.dumps(out), flush=True)


def run_variant(name, args, data, out, rep):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--alloc", driver.variant(name)[0], "--data", data,
           "--epochs", str(args.epochs), "--batch", str(args.batch), "--imgsz", str(args.imgsz),
           "--model", args.model, "--project", os.path.join(out, "runs"), "--name", f"{name}-{rep}"]
    logs = os.path.join(out, "yolo-logs")
    os.makedirs(logs, exist_ok=True)
    trace = None
    if name.endswith("-traced"):
        os.makedirs(os.path.join(out, "traces"), exist_ok=True)
        trace = os.path.abspath(os.path.join(out, "traces", f"yolo-{rep}.gtrace"))
    p = driver.run_child(cmd, name, CHILD_TIMEOUT_S, logs, f"{name}-{rep}", trace)
    res = {"variant": name, "repeat": rep, "rc": p.pop("rc"), "wall_s": p.pop("wall_s")}
    if "error" in p:
        res["error"] = f"{p['error']}\n{p.get('stderr_tail', '')}"
    else:
        res["result"] = p
    return res


def per_epoch(rs, key, spec):
    """The median over runs `rs` of `key` in each epoch all of them reached,
    formatted with `spec`, as "a / b / c" ("-" where no run counted it)."""
    cells = []
    for i in range(min(len(r["epochs"]) for r in rs)):
        xs = [r["epochs"][i].get(key) for r in rs]
        cells.append(bench.fmt(bench.median(xs), spec))
    return " / ".join(cells)


def table(runs, variants):
    rows = ["| variant | runs | R/A | epoch times, s (train + val) | total s | device allocations | driver ms "
            "| final losses |",
            "|---|---|---|---|---|---|---|---|"]
    for v in variants:
        rs = [r["result"] for r in runs if r["variant"] == v and "result" in r]
        if not rs:
            err = next((r for r in runs if r["variant"] == v), {})
            rows.append(f"| {v} | 0 | failed rc={err.get('rc')} | | | | | |")
            continue
        ra = statistics.median(r["peak_reserved_over_allocated"] for r in rs)
        tot = statistics.median(r["total_s"] for r in rs)
        loss = rs[0]["final_losses"]
        loss_text = " ".join(f"{k} {x:.4f}" for k, x in loss.items()) if loss else "-"
        rows.append(f"| {v} | {len(rs)} | {ra:.4f} | {per_epoch(rs, 'epoch_s', '.2f')} | {tot:.1f} | "
                    f"{per_epoch(rs, 'device_allocs', '.0f')} | {per_epoch(rs, 'driver_ms', '.1f')} | {loss_text} |")
    rows.append("")
    rows.append("Device allocations and driver time are per epoch; driver time is gpualloc's own count.")
    ratios = ratio_table(runs, variants)
    return "\n".join(rows + ([""] + ratios if ratios else []))


def time_ratios(runs, ours=OURS):
    """Per repeat, `ours`'s time of each epoch and of the whole run over the
    faster PyTorch mode's in that repeat: {"epoch 1": [r0, r1, ...], ...,
    "total": [...]}, only for repeats where both ran."""
    by = {}
    for r in runs:
        if "result" in r:
            by.setdefault(r["repeat"], {})[r["variant"]] = r["result"]
    out = {}
    for rep in sorted(by):
        mine = by[rep].get(ours)
        natives = [by[rep][v] for v in bench.NATIVE if v in by[rep]]
        if not mine or not natives:
            continue
        n = min(len(x["epochs"]) for x in [mine] + natives)
        for i in range(n):
            base = min(x["epochs"][i]["epoch_s"] for x in natives)
            out.setdefault(f"epoch {i + 1}", []).append(mine["epochs"][i]["epoch_s"] / base)
        out.setdefault("total", []).append(mine["total_s"] / min(x["total_s"] for x in natives))
    return out


def ratio_table(runs, variants, ours=OURS):
    """The target "epoch times <= PyTorch expandable's" (here: the faster
    PyTorch mode of each repeat), per epoch and for the whole run, with the
    95% interval over repeats and its verdict; [] when `ours` and no PyTorch
    mode ran."""
    if ours not in variants or not any(v in variants for v in bench.NATIVE):
        return []
    ratios = time_ratios(runs, ours)
    if not ratios:
        return [f"{ours} against PyTorch: no repeat where both ran."]
    rows = [f"{ours}'s time against the faster PyTorch mode of each repeat:", "",
            "| | runs | median ratio | 95% interval | <= 1.00x |", "|---|---|---|---|---|"]
    for k, rs in ratios.items():
        rows.append(f"| {k} | {len(rs)} | {statistics.median(rs):.3f} | {bench.fmt_interval(bench.ratio_interval(rs))} "
                    f"| {bench.verdict_ratio(rs, 1.0)} |")
    rows += ["", bench.INTERVAL_NOTE]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--imgsz", type=int, default=320)
    ap.add_argument("--images", type=int, default=512)
    ap.add_argument("--model", default="yolov8n.yaml")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variants", default="native,native-expandable,gpualloc")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--alloc")
    ap.add_argument("--data")
    ap.add_argument("--project")
    ap.add_argument("--name")
    args = ap.parse_args()
    cfg = os.environ.setdefault("YOLO_CONFIG_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "yolo-config"))
    os.environ.setdefault("YOLO_OFFLINE", "1")
    if args.child:
        return child(args)
    os.makedirs(cfg, exist_ok=True)
    font = os.path.join(cfg, "Arial.ttf")
    if not os.path.exists(font):  # any TrueType font: Ultralytics only wants the file
        import matplotlib

        src = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "fonts", "ttf", "DejaVuSans.ttf")
        with open(src, "rb") as s, open(font, "wb") as d:
            d.write(s.read())
    os.makedirs(args.out, exist_ok=True)
    data = make_dataset(os.path.join(os.environ.get("TMPDIR", "/tmp"), "yolo-synthetic"), args.images)
    variants = driver.parse_variants(args.variants)
    runs = []
    for rep in range(args.repeats):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for v in order:
            r = run_variant(v, args, data, args.out, rep)
            print(json.dumps({k: r[k] for k in r if k != "error"})[:600], flush=True)
            if "error" in r:
                print(f"{v}: FAILED rc={r['rc']}\n{r['error'][-1500:]}", flush=True)
            runs.append(r)
    driver.write_results(args.out, "yolo", table(runs, variants), runs)


if __name__ == "__main__":
    main()
