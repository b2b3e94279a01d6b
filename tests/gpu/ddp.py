"""DDP with NCCL, one process per GPU, launched by torchrun (tests/gpu/ddp.sh).

    torchrun --nproc_per_node=2 tests/gpu/ddp.py --alloc native|gpualloc --out result.json

Trains a small CNN with changing batch sizes for a few steps under
DistributedDataParallel and writes rank 0's losses, the allocator backend and
peak memory to --out, so that ddp.sh can compare PyTorch's allocator with
gpualloc (also with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1).
"""

from __future__ import annotations

import argparse
import json
import os


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--alloc", choices=["native", "gpualloc"], required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.alloc == "gpualloc":
        import gpualloc

        gpualloc.install(config=os.environ.get("GPUALLOC_TEST_CONF") or None)
    import torch
    import torch.distributed as dist

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    torch.manual_seed(0)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10),
    ).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    losses = []
    for step in range(args.steps):
        b, hw = [8, 16, 24][step % 3], [32, 48, 64][(step // 3) % 3]
        x = torch.randn(b, 3, hw, hw, device="cuda", generator=gen)
        t = torch.randint(0, 10, (b,), device="cuda", generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(ddp(x), t)
        loss.backward()
        opt.step()
        # Every rank's loss, gathered: the same numbers on every rank.
        all_losses = [torch.zeros((), device="cuda") for _ in range(dist.get_world_size())]
        dist.all_gather(all_losses, loss.detach())
        losses.append([float(v) for v in all_losses])
    # The parameters must agree across ranks after DDP's all-reduces.
    flat = torch.cat([q.detach().flatten() for q in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    in_sync = bool(torch.equal(flat, ref))
    graph_allreduce = captured_all_reduce(torch, dist)
    torch.cuda.synchronize()
    result = {
        "rank": rank,
        "backend": torch.cuda.get_allocator_backend(),
        "losses": losses,
        "params_in_sync": in_sync,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "register_hook": os.environ.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "0"),
        "graph_allreduce_ok": graph_allreduce,
        "nccl_graph_register": os.environ.get("NCCL_GRAPH_REGISTER"),
    }
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def captured_all_reduce(torch, dist) -> bool:
    """An all-reduce captured in a CUDA graph over a 48 MiB buffer (several
    of gpualloc's handles), replayed with new inputs: NCCL's graph
    registration of such buffers faults or hangs on mapped memory (Note
    [NCCL's graph registration] in python-shim/gpualloc/_torch.py), which
    install() turns off. Whether every replay summed right on this rank."""
    n, world, ok = 12 << 20, dist.get_world_size(), True
    buf = torch.zeros(n, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # NCCL's warm-up outside the capture
        dist.all_reduce(buf)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(buf)
    for k in range(3):
        buf.fill_(float(dist.get_rank() + k))
        graph.replay()
        torch.cuda.synchronize()
        want = float(sum(r + k for r in range(world)))
        ok = ok and bool(torch.all(buf == want))
    del graph
    return ok


if __name__ == "__main__":
    main()
