"""Records the example trace the README's first command reports on: a
multi-scale YOLO-style detector trained the way YOLO users train, under
gpualloc with its automatic steps and phases, ending in an out-of-memory
error as the image size grows.

    python3 tests/gpu/record_example.py --out examples/yolo-style-oom.gtrace [--steps 36]

(tests/gpu/env.sh sets up the library and the Python path.) The run:
- picks an image size per step from 320-640 px (multi-scale), batch 8;
- trains with AMP (autocast + GradScaler) and gradient accumulation over 2
  micro-batches per optimizer step;
- saves a checkpoint every 8 optimizer steps as YOLO trainers do (a half
  precision copy of the model on the GPU, then torch.save) and runs an
  evaluation pass (model.eval(), no_grad) every 12;
- runs under `memory_limit` (default 1700 MiB, as a smaller GPU would; it is
  in the trace's configuration, so replays see the same limit), and after
  the steps raises the image size until torch.cuda.OutOfMemoryError.
The trace records every allocation, the optimizer steps (marks), the
backward / optimizer / eval / checkpoint phases and the failed request.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="trace path (.gtrace)")
    ap.add_argument("--steps", type=int, default=36, help="optimizer steps before the memory cap")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--limit", default="1700MiB", help="gpualloc's memory_limit")
    args = ap.parse_args()

    import gpualloc

    gpualloc.install(config=f"memory_limit:{args.limit}", trace=args.out)
    import torch

    from models import MultiScaleDetector

    torch.manual_seed(0)
    rng = random.Random(0)
    dev = torch.device("cuda:0")
    model = MultiScaleDetector().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    accumulate = 2

    def micro_batch(size):
        x = torch.randn(args.batch, 3, size, size, device=dev)
        with torch.autocast("cuda", dtype=torch.float16):
            outs = model(x)
            return sum(o.float().pow(2).mean() for o in outs)

    def step(size):
        for _ in range(accumulate):
            loss = micro_batch(size) / accumulate
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def evaluate():
        model.eval()
        with torch.no_grad():
            for size in (320, 480, 640):
                x = torch.randn(args.batch, 3, size, size, device=dev)
                with torch.autocast("cuda", dtype=torch.float16):
                    model(x)
        model.train()

    losses = []
    for i in range(1, args.steps + 1):
        losses.append(step(32 * rng.randint(10, 20)))
        if i % 8 == 0:
            half = copy.deepcopy(model).half()
            torch.save({"model": half.state_dict(), "opt": opt.state_dict()}, io.BytesIO())
            del half
        if i % 12 == 0:
            evaluate()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    oom = None
    size = 640
    while oom is None and size <= 4096:
        size += 64
        try:
            losses.append(step(size))
        except torch.cuda.OutOfMemoryError as e:
            oom = {"image_size": size, "message": str(e).splitlines()[0][:300]}
    result = {
        "trace": args.out,
        "steps": args.steps,
        "losses_first_last": [losses[0], losses[-1]],
        "reserved_after_steps": reserved,
        "memory_limit": args.limit,
        "oom": oom,
        "trace_stop": gpualloc.trace_stop() if hasattr(gpualloc, "trace_stop") else None,
    }
    print("GPUALLOC_RESULT " + json.dumps(result, default=str), flush=True)
    return 0 if oom else 1


if __name__ == "__main__":
    sys.exit(main())
