"""Whether the host speed of a process depends on the CPU it runs on.

    python3 tests/gpu/host_probe.py --out DIR [--repeats 2] [--alloc native]

Host-bound training steps (GPT-2's short sequences, the detector's small
images) spread by up to 20% between two processes of one configuration
(`docs/results/README.md`, rounds 36 and 37), which single runs cannot
tell from a cost of the allocator. This probe starts one child process
per CPU the machine lets it use, pinned to that CPU
(`os.sched_setaffinity`), and one unpinned child per repeat; each child
initialises CUDA and times three host-bound loops under one allocator:

- `empty0_us`: `torch.empty(0)` on the GPU, which no allocator serves
  (Python, the dispatcher and the tensor only);
- `launch_us`: `x.add_(1)` on a 1 KiB tensor, one kernel launch each,
  synchronised every 1,000;
- `alloc_us`: `torch.empty` of 1 MiB freed at once (one alloc+free).

It writes DIR/host_probe.json and a table with the NUMA node of each CPU
and the CPUs the GPU's PCI device reports as local, so that a spread
that follows the node shows up as such."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _best_us(fn, n, rounds=5):
    """The fastest of `rounds` timings of `fn(n)`, in µs per iteration."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(n)
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return round(best, 4)


def child(alloc: str) -> dict:
    if alloc == "gpualloc":
        import gpualloc

        gpualloc.install()
    import torch

    dev = torch.device("cuda:0")
    x = torch.zeros(256, device=dev)
    torch.cuda.synchronize()

    def empty0(n):
        for _ in range(n):
            torch.empty(0, device=dev)

    def launch(n):
        for i in range(n):
            x.add_(1)
            if i % 1000 == 999:
                torch.cuda.synchronize()
        torch.cuda.synchronize()

    def alloc1m(n):
        for _ in range(n):
            torch.empty(1 << 20, dtype=torch.uint8, device=dev)

    for f in (empty0, launch, alloc1m):
        f(2000)
    return {
        "cpus": sorted(os.sched_getaffinity(0)),
        "empty0_us": _best_us(empty0, 20000),
        "launch_us": _best_us(launch, 20000),
        "alloc_us": _best_us(alloc1m, 20000),
    }


def numa_of_cpus() -> dict:
    """cpu -> NUMA node, from /sys (empty where the machine does not say)."""
    out = {}
    base = "/sys/devices/system/node"
    if not os.path.isdir(base):
        return out
    for node in os.listdir(base):
        if not node.startswith("node") or not node[4:].isdigit():
            continue
        for cpu in parse_cpulist(open(os.path.join(base, node, "cpulist")).read()):
            out[cpu] = int(node[4:])
    return out


def parse_cpulist(text: str) -> list:
    """"0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11]; ValueError on anything else."""
    cpus = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def gpu_local_cpus() -> list:
    """The CPUs the first GPU's PCI device calls local (nvidia-smi's bus id
    under /sys/bus/pci); [] where either is missing."""
    try:
        bus = subprocess.run(
            ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return []
    if not bus:
        return []
    # nvidia-smi prints an 8-digit domain, /sys a 4-digit one.
    path = f"/sys/bus/pci/devices/{bus[-12:].lower()}/local_cpulist"
    try:
        return parse_cpulist(open(path).read())
    except (OSError, ValueError):
        return []


def run_child(alloc: str, cpu) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--alloc", alloc]
    pre = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=pre)
    for line in p.stdout.splitlines():
        if line.startswith("GPUALLOC_RESULT "):
            return json.loads(line[len("GPUALLOC_RESULT "):])
    return {"error": f"rc={p.returncode}: {p.stderr[-400:]}"}


def table(rows: list, local: list) -> str:
    lines = [
        "| cpu | NUMA node | GPU-local | empty(0) µs | launch µs | 1 MiB alloc+free µs |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        cpu = r["cpu"]
        here = "" if cpu is None or not local else ("yes" if cpu in local else "no")
        lines.append(
            f"| {'any' if cpu is None else cpu} | {r.get('node', '')} | {here} | {r.get('empty0_us', r.get('error'))} "
            f"| {r.get('launch_us', '')} | {r.get('alloc_us', '')} |"
        )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--alloc", default="native", choices=["native", "gpualloc"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", action="store_true")
    args = p.parse_args()
    if args.child:
        print("GPUALLOC_RESULT " + json.dumps(child(args.alloc)), flush=True)
        return
    nodes, local = numa_of_cpus(), gpu_local_cpus()
    rows = []
    for rep in range(args.repeats):
        for cpu in [None] + sorted(os.sched_getaffinity(0)):
            r = run_child(args.alloc, cpu)
            r.update(cpu=cpu, repeat=rep, node=nodes.get(cpu, "") if cpu is not None else "")
            rows.append(r)
            print(json.dumps(r), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "host_probe.json"), "w") as f:
        json.dump({"alloc": args.alloc, "gpu_local_cpus": local, "rows": rows}, f, indent=1)
    md = table(rows, local)
    with open(os.path.join(args.out, "host_probe.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
