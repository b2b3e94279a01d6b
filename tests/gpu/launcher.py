"""`python -m gpualloc run` on a real program: the launcher's promises,
checked with real torch and a GPU. Used by `checks.py launcher`.

The program (written to a temporary folder) trains a small model from a
DataLoader with two forked workers, starts a `spawn` process that
allocates on the GPU, and prints what it saw. It is run as a user would,
`python -m gpualloc run --trace DIR/t-{pid}.gtrace prog.py a -- b`, with
none of gpualloc's calls in it. The check passes when:

- the program sees its arguments, its own `__file__` and folder, as under
  `python prog.py a -- b`;
- the program and its spawned process both allocate through gpualloc
  (`torch.cuda.get_allocator_backend()`), with correct results;
- each of the two wrote its own trace, with allocations in it, and the
  program's trace holds one `step` mark per optimizer step (automatic
  marks); the forked DataLoader workers, which never touch CUDA, wrote
  none with allocations."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile

PROGRAM = r'''
import json, os, sys
import torch
import torch.multiprocessing as mp


def spawned(q):
    x = torch.ones(1 << 20, device="cuda")
    q.put({"backend": torch.cuda.get_allocator_backend(), "sum": float(x.sum()), "pid": os.getpid()})


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((32,), float(i)), i % 4


if __name__ == "__main__":
    out = {"argv": sys.argv[1:], "file": __file__, "path0": sys.path[0], "pid": os.getpid()}
    model = torch.nn.Linear(32, 4).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 0
    loader = torch.utils.data.DataLoader(Data(), batch_size=16, num_workers=2, multiprocessing_context="fork")
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    torch.cuda.synchronize()
    out["steps"] = steps
    out["loss_finite"] = bool(torch.isfinite(loss).item())
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=spawned, args=(q,))
    p.start()
    out["spawned"] = q.get(timeout=180)
    p.join(60)
    out["spawned_exitcode"] = p.exitcode
    out["backend"] = torch.cuda.get_allocator_backend()
    print("LAUNCHER_RESULT " + json.dumps(out), flush=True)
'''


def _trace_summary(path: str) -> dict:
    from gpualloc.tracefile import annotations, records

    try:
        recs = records(path)
        marks = [a["name"] for a in annotations(path) if a["kind"] == "mark"]
    except ValueError as e:  # damaged or truncated: a failure of the check, reported
        return {"allocs": -1, "error": str(e)}
    return {"allocs": sum(r["kind"] == "alloc" for r in recs), "step_marks": marks.count("step")}


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def check_launcher(args) -> dict:
    if args.alloc != "gpualloc":
        return {"skipped": "launcher needs --alloc gpualloc"}
    with tempfile.TemporaryDirectory() as d:
        prog = os.path.join(d, "prog.py")
        with open(prog, "w") as f:
            f.write(PROGRAM)
        # The program chooses nothing: no variant's settings reach it.
        env = dict(os.environ)
        for k in ("GPUALLOC_TEST_CONF", "GPUALLOC_TEST_TRACE", "GPUALLOC_CONF", "GPUALLOC_TRACE", "PYTORCH_CUDA_ALLOC_CONF"):
            env.pop(k, None)
        cmd = [sys.executable, "-m", "gpualloc", "run", "--trace", os.path.join(d, "t-{pid}.gtrace"), prog, "a", "--", "b"]
        # Its own process group, so that a hang leaves no process behind
        # (the program, its spawned child, the workers) holding the GPU.
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=d,
                             start_new_session=True)
        try:
            stdout, stderr = p.communicate(timeout=240)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            stdout, stderr, rc = _text(out), _text(err), "timeout"
        seen = None
        for line in stdout.splitlines():
            if line.startswith("LAUNCHER_RESULT "):
                seen = json.loads(line[len("LAUNCHER_RESULT "):])
        out = {"rc": rc, "program": seen, "stderr_tail": stderr[-1500:]}
        if seen is None:
            out["ok"] = False
            return out
        traces = {os.path.basename(t): _trace_summary(t) for t in sorted(glob.glob(os.path.join(d, "*.gtrace")))}
        out["traces"] = traces
        mine = traces.get(f"t-{seen['pid']}.gtrace", {})
        child = traces.get(f"t-{seen['spawned'].get('pid')}.gtrace", {})
        others = {k: v for k, v in traces.items() if k not in (f"t-{seen['pid']}.gtrace", f"t-{seen['spawned'].get('pid')}.gtrace")}
        checks = {
            "arguments": seen["argv"] == ["a", "--", "b"],
            "file_and_folder": seen["file"] == prog and os.path.realpath(seen["path0"]) == os.path.realpath(d),
            "program_on_gpualloc": seen["backend"] == "gpualloc" and seen["loss_finite"],
            "spawned_on_gpualloc": seen["spawned"].get("backend") == "gpualloc"
            and seen["spawned"].get("sum") == float(1 << 20) and seen["spawned_exitcode"] == 0,
            "program_trace": mine.get("allocs", 0) > 0 and mine.get("step_marks") == seen["steps"],
            "spawned_trace": child.get("allocs", 0) > 0,
            "workers_wrote_no_allocations": all(v["allocs"] == 0 for v in others.values()),
            "traces_readable": all(v["allocs"] >= 0 for v in traces.values()),
        }
        out["checks"] = checks
        out["passed"], out["total"] = sum(checks.values()), len(checks)
        out["ok"] = rc == 0 and all(checks.values())
        return out
