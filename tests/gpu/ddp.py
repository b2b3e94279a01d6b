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
    torch.cuda.synchronize()
    result = {
        "rank": rank,
        "backend": torch.cuda.get_allocator_backend(),
        "losses": losses,
        "params_in_sync": in_sync,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "register_hook": os.environ.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "0"),
    }
    with open(f"{args.out}.rank{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
