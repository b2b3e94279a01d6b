"""Real third-party training loops end to end, besides YOLO (yolo.py): the
Hugging Face `Trainer` on a randomly initialised GPT-2 small with dynamic
padding (every batch padded to its own longest sequence), and PyTorch
Lightning on a multi-scale ResNet-50 (every batch at its own resolution),
under PyTorch's allocator (native, native-expandable) and gpualloc, each
run in its own process.

    python3 tests/gpu/trainers.py --out DIR [--libraries hf,lightning]
        [--steps 40] [--repeats 2] [--variants native,native-expandable,gpualloc]
        [--profile-steps FIRST:LAST]

Both libraries ship with torch on most GPU machines; nothing is downloaded
(the GPT-2 is built from its config, the batches are random). Writes
DIR/trainers.json and DIR/trainers.md: per library and variant, the wall
time of training, mean and median step time, the mean step over the faster
of the two PyTorch modes (within each repeat; with two repeats or more, the
95% interval over repeats and whether it is at most 1.00x), peak reserved
over peak allocated, the last loss and gpualloc's driver counters.
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
from step_profiler import StepProfiler, parse_window  # noqa: E402

CHILD_TIMEOUT_S = 600
NATIVE = ("native", "native-expandable")
COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_driver_calls", "driver_time_ns",
            "num_defragment", "num_stitch")


def hf_run(args, steps_ms, prof):
    """Hugging Face Trainer: GPT-2 small from its config, random token
    sequences of 32-768 tokens, padded per batch by the collator."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    rng = random.Random(0)
    cfg = GPT2Config(n_positions=1024)
    data = [{"input_ids": [rng.randrange(1, cfg.vocab_size) for _ in range(rng.randint(32, 768))]}
            for _ in range(args.steps * args.batch)]

    def collate(batch):
        n = max(len(b["input_ids"]) for b in batch)
        ids = torch.zeros((len(batch), n), dtype=torch.long)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, b in enumerate(batch):
            ids[i, :len(b["input_ids"])] = torch.tensor(b["input_ids"])
            mask[i, :len(b["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    class Steps(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            prof.begin()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            torch.cuda.synchronize()
            steps_ms.append((time.perf_counter() - self.t0) * 1e3)
            prof.end()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    targs = TrainingArguments(output_dir=os.path.join(args.tmp, "hf"), per_device_train_batch_size=args.batch,
                              max_steps=args.steps, learning_rate=3e-4, logging_steps=args.steps, save_strategy="no",
                              report_to="none", bf16=torch.cuda.is_bf16_supported(), dataloader_num_workers=0,
                              seed=0, disable_tqdm=True, remove_unused_columns=False)
    trainer = Trainer(model=model, args=targs, train_dataset=data, data_collator=collate, callbacks=[Steps()])
    out = trainer.train()
    return float(out.training_loss)


def lightning_run(args, steps_ms, prof):
    """PyTorch Lightning: ResNet-50 on random images, every batch at a
    resolution of 160-512 px drawn per step (made on the GPU, so the loop is
    bound by the GPU and the allocator, not by a data loader)."""
    import torch
    import torch.nn.functional as F
    import torchvision

    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl

    class Sizes(torch.utils.data.Dataset):
        def __init__(self, n):
            rng = random.Random(0)
            self.sizes = [rng.randrange(160, 513, 32) for _ in range(n)]

        def __len__(self):
            return len(self.sizes)

        def __getitem__(self, i):
            return self.sizes[i]

    class Net(pl.LightningModule):
        def __init__(self, batch):
            super().__init__()
            self.batch = batch
            self.model = torchvision.models.resnet50(num_classes=100)
            self.last = None

        def training_step(self, size, i):
            s = int(size[0])
            g = torch.Generator(device=self.device).manual_seed(i)
            x = torch.randn((self.batch, 3, s, s), device=self.device, generator=g)
            y = torch.randint(0, 100, (self.batch,), device=self.device, generator=g)
            loss = F.cross_entropy(self.model(x), y)
            self.last = loss.detach()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Steps(pl.Callback):
        def on_train_batch_start(self, trainer, module, batch, i):
            prof.begin()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            torch.cuda.synchronize()
            steps_ms.append((time.perf_counter() - self.t0) * 1e3)
            prof.end()

    torch.manual_seed(0)
    net = Net(args.batch)
    precision = "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    trainer = pl.Trainer(max_steps=args.steps, accelerator="gpu", devices=1, precision=precision, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[Steps()], default_root_dir=os.path.join(args.tmp, "pl"))
    loader = torch.utils.data.DataLoader(Sizes(args.steps), batch_size=1, shuffle=False)
    trainer.fit(net, loader)
    return float(net.last)


LIBRARIES = {"hf": (hf_run, 16), "lightning": (lightning_run, 64)}


def child(args):
    """One training run in this process, under the allocator of --alloc."""
    import torch

    if args.alloc == "gpualloc":
        import gpualloc

        gpualloc.install(config=os.environ.get("GPUALLOC_TEST_CONF") or None,
                         trace=os.environ.get("GPUALLOC_TEST_TRACE") or None)
    steps_ms = []
    prof = StepProfiler(args.profile_steps)
    t0 = time.perf_counter()
    loss = LIBRARIES[args.library][0](args, steps_ms, prof)
    prof.finish()
    torch.cuda.synchronize()
    out = {"total_s": time.perf_counter() - t0, "steps_ms": steps_ms, "final_loss": loss,
           "peak_reserved": torch.cuda.max_memory_reserved(), "peak_allocated": torch.cuda.max_memory_allocated()}
    out["peak_reserved_over_allocated"] = out["peak_reserved"] / max(1, out["peak_allocated"])
    stats = torch.cuda.memory_stats()
    if args.alloc == "gpualloc":
        stats.update(gpualloc.stats())
    out["counters"] = {k: stats.get(k) for k in COUNTERS}
    out.update(prof.report())
    print("GPUALLOC_RESULT " + json.dumps(out), flush=True)


def run_variant(library, name, args, rep):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--library", library, "--alloc",
           driver.variant(name)[0], "--steps", str(args.steps), "--batch", str(args.batch or LIBRARIES[library][1]),
           "--tmp", os.path.join(args.tmp, f"{library}-{name}-{rep}")]
    if args.profile_steps:
        cmd += ["--profile-steps", args.profile_steps]
    logs = os.path.join(args.out, "trainers-logs")
    os.makedirs(logs, exist_ok=True)
    trace = None
    if name.endswith("-traced"):
        os.makedirs(os.path.join(args.out, "traces"), exist_ok=True)
        trace = os.path.abspath(os.path.join(args.out, "traces", f"{library}-{rep}.gtrace"))
    p = driver.run_child(cmd, name, CHILD_TIMEOUT_S, logs, f"{library}-{name}-{rep}", trace)
    res = {"library": library, "variant": name, "repeat": rep, "rc": p.pop("rc"), "wall_s": p.pop("wall_s")}
    if "error" in p:
        res["error"] = f"{p['error']}\n{p.get('stderr_tail', '')}"
    else:
        p["mean_step_ms"] = statistics.fmean(p["steps_ms"]) if p["steps_ms"] else None
        p["median_step_ms"] = statistics.median(p["steps_ms"]) if p["steps_ms"] else None
        res["result"] = p
    return res


def table(runs, libraries, variants):
    """Medians over repeats; the mean-step ratio is taken within each repeat
    against the faster PyTorch mode of that repeat, then its median."""
    rows = ["| library | variant | runs | R/A | total s | mean step ms | median step ms | mean step vs faster PyTorch "
            "| 95% interval | <= 1.00x | last loss | device allocs | driver calls | driver ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lib in libraries:
        ok = [r for r in runs if r["library"] == lib and "result" in r]
        base = {}
        for r in ok:
            if r["variant"] in NATIVE:
                m = r["result"]["mean_step_ms"]
                base[r["repeat"]] = min(base.get(r["repeat"], m), m)
        for v in variants:
            rs = [r for r in ok if r["variant"] == v]
            if not rs:
                err = next((r for r in runs if r["library"] == lib and r["variant"] == v), {})
                rows.append(f"| {lib} | {v} | 0 | failed rc={err.get('rc')} | | | | | | | | | | |")
                continue

            def med(key, rs=rs):
                return statistics.median(r["result"][key] for r in rs)

            ratios = [r["result"]["mean_step_ms"] / base[r["repeat"]] for r in rs if r["repeat"] in base]
            c = rs[0]["result"]["counters"]
            ns = c.get("driver_time_ns")
            rows.append(f"| {lib} | {v} | {len(rs)} | {med('peak_reserved_over_allocated'):.4f} | {med('total_s'):.1f} "
                        f"| {med('mean_step_ms'):.1f} | {med('median_step_ms'):.1f} "
                        f"| {statistics.median(ratios) if ratios else float('nan'):.3f} "
                        f"| {bench.fmt_interval(bench.ratio_interval(ratios))} "
                        f"| {bench.verdict_ratio(ratios, 1.0) if v not in NATIVE else '–'} | {med('final_loss'):.4f} "
                        f"| {c.get('num_device_alloc')} | {c.get('num_driver_calls') if c.get('num_driver_calls') is not None else '-'} "
                        f"| {ns / 1e6 if ns is not None else float('nan'):.1f} |")
    return "\n".join(rows + ["", bench.INTERVAL_NOTE])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-results"))
    ap.add_argument("--libraries", default="hf,lightning")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=0, help="batch size (default: 16 for hf, 64 for lightning)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="native,native-expandable,gpualloc")
    ap.add_argument("--tmp", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpualloc-trainers"))
    ap.add_argument("--profile-steps", default="", help="FIRST:LAST: profile the CUDA kernels of these steps")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--library", choices=sorted(LIBRARIES))
    ap.add_argument("--alloc")
    args = ap.parse_args()
    if args.child:
        return child(args)
    libraries = [x for x in args.libraries.split(",") if x]
    for lib in libraries:
        if lib not in LIBRARIES:
            ap.error(f"--libraries: unknown library {lib!r}: one of {', '.join(LIBRARIES)}")
    variants = driver.parse_variants(args.variants)
    try:
        parse_window(args.profile_steps)
    except ValueError as e:
        ap.error(f"--profile-steps: {e}")
    os.makedirs(args.out, exist_ok=True)
    if any(driver.variant(v)[0] == "gpualloc" for v in variants):
        driver.build_bridge(args.out)  # once, outside every timed run
    runs = []
    for rep in range(args.repeats):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for lib in libraries:
            for v in order:
                r = run_variant(lib, v, args, rep)
                brief = {k: r[k] for k in r if k not in ("error", "result")}
                if "result" in r:
                    brief.update({k: r["result"][k] for k in ("total_s", "mean_step_ms", "peak_reserved_over_allocated")})
                print(json.dumps(brief), flush=True)
                if "error" in r:
                    print(f"{lib} {v}: FAILED rc={r['rc']}\n{r['error'][-1500:]}", flush=True)
                runs.append(r)
    driver.write_results(args.out, "trainers", table(runs, libraries, variants), runs)


if __name__ == "__main__":
    main()
