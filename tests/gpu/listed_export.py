"""Each byte once, on a GPU (Note [Listed ranges] in
allocator/src/trace/event.rs): a multi-scale detector trained under
gpualloc with a trace and PyTorch's memory history, both recording while
stitches are taken into use and given back. Then:

- the trace exported with `gpualloc export --torch-snapshot` and PyTorch's
  own dump (`torch.cuda.memory._dump_snapshot`, made from gpualloc's
  segment events by the bridge) are each checked as MemoryViz reads them
  (cli/tests/check_snapshot.py), and the most bytes either shows in
  segments at once must not pass the most memory reserved;
- their final segments, coalesced, must be the same ranges.

    python3 tests/gpu/listed_export.py --out DIR [--steps 40]

(tests/gpu/env.sh sets up the library and the Python path; expects
target/release/gpualloc.) Prints one JSON line; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
CLI = os.environ.get("GPUALLOC_CLI", os.path.join(ROOT, "target", "release", "gpualloc"))
CHECK = os.path.join(ROOT, "cli", "tests", "check_snapshot.py")


def coalesced(snapshot: dict) -> list:
    """The final segments of device 0 as disjoint ranges, adjacent merged."""
    ranges = sorted((s["address"], s["address"] + s["total_size"]) for s in snapshot["segments"] if s["device"] == 0)
    out = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def checked(path: str) -> dict:
    """check_snapshot.py's verdict on a pickle, and the most bytes in segments."""
    run = subprocess.run([sys.executable, CHECK, path], capture_output=True, text=True)
    most = [int(l.split()[4]) for l in run.stdout.splitlines() if l.startswith("device 0: at most ")]
    return {"ok": run.returncode == 0, "error": run.stderr.strip()[-400:], "most_in_segments": most[0] if most else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    trace = os.path.join(args.out, "listed.gtrace")
    dumped = os.path.join(args.out, "listed-torch.pickle")
    exported = os.path.join(args.out, "listed-export.pickle")

    import gpualloc

    gpualloc.install(trace=trace)
    import torch

    from checks import _detection_loss
    from models import MultiScaleDetector

    torch.manual_seed(0)
    rng = random.Random(3)
    dev = torch.device("cuda:0")
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    model = MultiScaleDetector(classes=20).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(args.steps):
        size = rng.choice(range(256, 641, 32))
        x = torch.randn(8, 3, size, size, device=dev)
        loss = _detection_loss(x, model(x))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(dumped)
    torch.cuda.memory._record_memory_history(enabled=None)
    stats = gpualloc.stats(0)
    max_reserved = torch.cuda.max_memory_reserved()
    gpualloc.trace_stop()
    export = subprocess.run([CLI, "export", trace, "--torch-snapshot", exported], capture_output=True, text=True)
    result = {
        "steps": args.steps,
        "stitches": stats.get("num_stitch"),
        "max_reserved": max_reserved,
        "export_rc": export.returncode,
        "export_stderr": export.stderr.strip()[-400:],
    }
    failures = []
    if export.returncode != 0:
        failures.append("export failed")
    else:
        result["exported"] = checked(exported)
        result["torch_dump"] = checked(dumped)
        for name in ("exported", "torch_dump"):
            c = result[name]
            if not c["ok"]:
                failures.append(f"{name}: {c['error']}")
            elif c["most_in_segments"] is None or c["most_in_segments"] > max_reserved:
                failures.append(f"{name}: {c['most_in_segments']} bytes in segments at once, above {max_reserved} reserved")
        with open(exported, "rb") as f:
            a = coalesced(pickle.load(f))
        with open(dumped, "rb") as f:
            b = coalesced(pickle.load(f))
        result["final_ranges"] = [len(a), len(b)]
        if a != b:
            failures.append(f"final segments differ: export {len(a)} ranges, torch {len(b)}")
    if not stats.get("num_stitch"):
        failures.append("no stitch was built: the check saw nothing of what it checks")
    result["failures"] = failures
    print(json.dumps(result))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
