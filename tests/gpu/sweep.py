"""Workloads the benchmark does not tune for, side by side under PyTorch's
allocator (with and without expandable segments) and gpualloc's defaults:
patterns that real training and inference code uses and that stress an
allocator differently from bench.py's four training loops.

    python3 tests/gpu/sweep.py --out DIR [--only generate,empty_cache]
        [--variants native,native-expandable,gpualloc] [--repeats 1] [--budget 540]

(tests/gpu/sweep.sh sets up the environment and calls this.) Each workload
runs under each variant in its own process (driver.run_child), interleaved
per repeat. A workload reports the time of each of its rounds (a training
step or one generate call, between two synchronizations), its outputs
(losses, or checksums of generated tokens) and the peaks; the summary gives
R/A, the mean over all rounds (round 0 included: the compile of
compile_dynamic) and the median from the fifth of the rounds on, each
against the faster PyTorch variant's, num_device_alloc (cudaMalloc calls
under PyTorch; mappings that created memory under gpualloc),
how far the outputs are from PyTorch's (bf16 and fp16 kernels may round
differently at other addresses: native-expandable differs too), the
rounds after the first fifth against the faster PyTorch variant's in the same
repeat (the rounds draw the same shapes, so they pair), and the
process's host speed before and after its rounds (`host_floor_us`, as the
trainings measure it); repeats whose processes ran at host speeds more
than 1.25x apart are named, since their host-bound rounds cannot rank the
allocators. Variant
gpualloc-traced records DIR/traces/WORKLOAD.gtrace. Writes DIR/sweep.md
and DIR/sweep.json.

- generate: transformers GPT-2 small (random weights, bf16) generating 64
  tokens greedily for batches of 4..32 prompts of 16..384 tokens, left
  padded: a KV cache that grows by one token a step, a new batch shape
  every call.
- empty_cache: torchvision resnet50, batch 64, with torch.cuda.empty_cache()
  after every step, as scripts that fight fragmentation by hand do.
- checkpoint_amp: transformers BERT-base masked LM with gradient
  checkpointing, AdamW and bf16 autocast on random lengths 32..512.
- vit_amp: timm vit_small_patch16_224, fp16 autocast with a GradScaler,
  batch 96, AdamW.
- compile_dynamic: torch.compile(dynamic=True) of models.TinyGPT on random
  lengths 64..512 (the compile is round 0).
- faster_rcnn: torchvision Faster R-CNN (ResNet-50 FPN) training on four
  images a step of random sizes and box counts: many small and odd-sized
  tensors, a new layout every step.
- side_stream: ResNet-18 training whose next batch is copied on a side
  stream and handed over with record_stream (cross-stream frees).
- lstm_varlen: a cuDNN LSTM on random batch sizes and lengths (cuDNN's
  workspace and reserve change size every step).
- reduce_overhead: torch.compile(mode="reduce-overhead") on three sequence
  lengths: CUDA graphs whose memory comes from private pools.
- serve_varbatch: fp16 ResNet-50 inference on requests of random batch
  sizes and resolutions, as a server sees them.
- graph_branches: two reduce-overhead graphs a step, the second on one of
  three lengths, so cudagraph trees record branches and put their pool
  back to checkpoints between them (setCheckpointPoolState).
- cudnn_benchmark: ResNet-50 training on six random input sizes with
  torch.backends.cudnn.benchmark on: cuDNN times each new convolution
  shape and then calls empty_cache (PyTorch's default), so the cache is
  emptied again and again while shapes are new (408 calls in 40 rounds).
  Each process picks its own algorithms by timing them, so its outputs
  drift from any other process's, PyTorch's two modes' included (up to
  100% after 40 rounds), and rounds can differ by the algorithms picked.
- fsdp: FSDP2 (`fully_shard`, one process, NCCL) over a transformers
  GPT-2 small with bf16 mixed precision and activation checkpointing on
  random lengths 64..512: FSDP's all-gather and reduce-scatter streams
  allocate and free the parameters' buffers every layer, ordered by
  events instead of record_stream.
- multi_stream: a four-branch CNN whose branches run forward (and so
  backward) on four streams of their own, on a random input size each
  step: every stream allocates and frees a changing layout.
- moe: a mixture-of-experts language model (six layers, eight expert MLPs,
  top-2 routing run expert by expert on the rows routed to it) with AdamW
  and bf16 autocast on random lengths 64..1024: how many rows each expert
  gets changes in every layer of every step, so activations of ever new
  sizes come and go.
- gnn: torch_geometric's SAGEConv and GCNConv (three layers, Adam) on a
  new random graph every step (20k..200k nodes, 5..20 edges a node):
  message passing gathers and scatters edge-sized tensors whose sizes
  never repeat.
- lora: peft LoRA (rank 16 on the attention and MLP projections) over a
  frozen bf16 transformers Llama (8 layers, width 1024, random weights)
  with gradient checkpointing, on batches of 8 padded to their own
  longest sequence (64..1024 tokens): the common fine-tuning recipe.
- accelerate: Hugging Face accelerate's `Accelerator` (bf16, gradient
  accumulation over 4 micro-batches, gradient clipping) training timm's
  convnext_tiny on a random resolution each micro-batch (160..288 px,
  batch 32).
- speech_ctc: transformers Wav2Vec2ForCTC (base size, random weights) on
  raw audio of a random length each step (1..12 s at 16 kHz, batch 8)
  with CTC targets of random lengths and bf16 autocast: the convolutional
  feature extractor's activations scale with the audio.
- t5_adafactor: transformers T5 (small size, random weights) trained with
  transformers' Adafactor (factored second moments, relative steps) on
  random source and target lengths (64..512 and 8..128 tokens, batch 16):
  an encoder-decoder whose two lengths change independently.
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

import driver  # noqa: E402
from step_profiler import StepProfiler  # noqa: E402

NATIVE = ("native", "native-expandable")
TIMEOUT_S = 240


# GPUALLOC_SWEEP_PROFILE_ROUNDS=FIRST:LAST profiles the kernels of those rounds
# (step_profiler.py); the result's "kernels", "host_ops" and "profiled_steps"
# (the rounds covered) say what it found. Made by child(), so a bad value
# fails the run, not the import.
PROFILER = StepProfiler(None)


def _timed(rounds, body):
    """Runs body(i) for each round between two synchronizations; returns
    (seconds per round, outputs)."""
    import torch

    times, outs = [], []
    torch.cuda.reset_peak_memory_stats()
    for i in range(rounds):
        torch.cuda.synchronize()
        PROFILER.begin()
        t0 = time.perf_counter()
        out = body(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        PROFILER.end()
        outs.append(out)
    PROFILER.finish()
    return times, outs


def _draws(seed):
    """The host's draws of a workload, both seeded with `seed`: Python's
    (shapes, sizes) and a CPU torch generator (data); neither touches
    torch's global seed, so models initialise alike in every variant."""
    import torch

    return random.Random(seed), torch.Generator().manual_seed(seed)


def _train_step(opt, loss_fn, dtype=None):
    """One optimizer step on loss_fn()'s loss (its forward under autocast to
    `dtype` when given); returns the loss."""
    import torch

    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
        loss = loss_fn()
    loss.backward()
    opt.step()
    return float(loss.detach())


def generate(rounds):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    dev = torch.device("cuda:0")
    cfg = GPT2Config(n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    model = GPT2LMHeadModel(cfg).to(dev, torch.bfloat16).eval()
    rng, g = _draws(7)

    def body(i):
        batch, length = rng.choice([4, 8, 16, 32]), rng.randrange(16, 385)
        ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=g)
        mask = torch.ones_like(ids)
        for row in range(batch):  # left padding, as for a decoder-only model
            pad = rng.randrange(0, length // 2)
            ids[row, :pad], mask[row, :pad] = cfg.eos_token_id, 0
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=64,
                                 min_new_tokens=64, do_sample=False, pad_token_id=cfg.eos_token_id)
        return int(out[:, length:].sum())

    return _timed(rounds, body), "transformers GPT-2 small, bf16, greedy, 64 new tokens, batch 4..32, prompts 16..384"


def empty_cache(rounds):
    import torch
    import torchvision

    dev = torch.device("cuda:0")
    model = torchvision.models.resnet50(num_classes=100).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 3, 160, 160, generator=g), torch.randint(0, 100, (64,), generator=g)) for _ in range(4)]

    def body(i):
        x, y = (t.to(dev) for t in data[i % len(data)])
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        del x, y
        torch.cuda.empty_cache()
        return float(loss.detach())

    return _timed(rounds, body), "torchvision resnet50, batch 64, 160x160, empty_cache() after every step"


def checkpoint_amp(rounds):
    import torch
    from transformers import BertConfig, BertForMaskedLM

    dev = torch.device("cuda:0")
    cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(cfg).to(dev)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng, g = _draws(11)

    def body(i):
        ids = torch.randint(0, cfg.vocab_size, (16, rng.randrange(32, 513)), generator=g).to(dev)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    return _timed(rounds, body), "transformers BERT-base MLM, gradient checkpointing, bf16 autocast, AdamW, batch 16, lengths 32..512"


def vit_training(dev):
    """timm's vit_small_patch16_224 (100 classes) with AdamW and an fp16
    GradScaler on `dev`, and four host batches of 96 images (seed 13):
    (step, batches), where step(x, y) trains on one batch and returns its
    loss. Also used by transfer_probe.py."""
    import timm
    import torch

    model = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=100).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    g = torch.Generator().manual_seed(13)
    data = [(torch.randn(96, 3, 224, 224, generator=g), torch.randint(0, 100, (96,), generator=g)) for _ in range(4)]

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return float(loss.detach())

    return step, data


def vit_amp(rounds):
    import timm
    import torch

    dev = torch.device("cuda:0")
    step, data = vit_training(dev)

    def body(i):
        return step(*(t.to(dev) for t in data[i % len(data)]))

    return _timed(rounds, body), f"timm {timm.__version__} vit_small_patch16_224, fp16 autocast + GradScaler, AdamW, batch 96"


def compile_dynamic(rounds):
    import torch

    from models import TinyGPT, next_token_loss

    dev = torch.device("cuda:0")
    vocab = 8192
    model = TinyGPT(vocab=vocab, dim=512, layers=6, heads=8).to(dev)
    step = torch.compile(model, dynamic=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng, g = _draws(17)

    def body(i):
        tokens = torch.randint(0, vocab, (16, rng.randrange(64, 513)), generator=g).to(dev)
        opt.zero_grad(set_to_none=True)
        logits = step(tokens)
        loss = next_token_loss(logits, tokens)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return _timed(rounds, body), "torch.compile(dynamic=True) TinyGPT (6 layers, 512 wide), AdamW, batch 16, lengths 64..512"


def faster_rcnn(rounds):
    import torch
    import torchvision

    dev = torch.device("cuda:0")
    model = torchvision.models.detection.fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None,
                                                                 num_classes=21).to(dev).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9)
    rng, g = _draws(19)

    def sample():
        h, w = rng.randrange(320, 961, 32), rng.randrange(320, 961, 32)
        n = rng.randrange(1, 12)
        xy = torch.rand(n, 2, generator=g) * torch.tensor([w * 0.7, h * 0.7])
        wh = 16 + torch.rand(n, 2, generator=g) * torch.tensor([w * 0.3, h * 0.3])
        target = {"boxes": torch.cat([xy, xy + wh], 1).to(dev),
                  "labels": torch.randint(1, 21, (n,), generator=g).to(dev)}
        return torch.rand(3, h, w, generator=g).to(dev), target

    def body(i):
        images, targets = zip(*(sample() for _ in range(4)))
        opt.zero_grad(set_to_none=True)
        loss = sum(model(list(images), list(targets)).values())
        loss.backward()
        opt.step()
        return float(loss.detach())

    return _timed(rounds, body), ("torchvision fasterrcnn_resnet50_fpn training, 4 images a step of random "
                                  "sizes 320..960, 1..11 boxes, SGD")


def side_stream(rounds):
    import torch
    import torchvision

    dev = torch.device("cuda:0")
    model = torchvision.models.resnet18(num_classes=100).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(23)
    host = [(torch.randn(128, 3, 160, 160, generator=g).pin_memory(), torch.randint(0, 100, (128,), generator=g))
            for _ in range(4)]
    copy = torch.cuda.Stream()

    def load(i):  # the next batch is copied on a side stream while this one trains
        with torch.cuda.stream(copy):
            x, y = host[i % len(host)]
            return x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    state = {"next": load(0)}

    def body(i):
        torch.cuda.current_stream().wait_stream(copy)
        x, y = state["next"]
        x.record_stream(torch.cuda.current_stream())
        y.record_stream(torch.cuda.current_stream())
        state["next"] = load(i + 1)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x.contiguous(memory_format=torch.channels_last)), y)
        loss.backward()
        opt.step()
        del x, y
        return float(loss.detach())

    return _timed(rounds, body), ("torchvision resnet18, batch 128, bf16, channels_last, the next batch copied on a "
                                  "side stream (record_stream)")


def lstm_varlen(rounds):
    import torch

    dev = torch.device("cuda:0")
    torch.backends.cudnn.benchmark = False
    model = torch.nn.LSTM(input_size=256, hidden_size=1024, num_layers=3, batch_first=True).to(dev)
    head = torch.nn.Linear(1024, 256).to(dev)
    opt = torch.optim.Adam(list(model.parameters()) + list(head.parameters()), lr=1e-3)
    rng, g = _draws(29)

    def body(i):
        batch, length = rng.choice([32, 48, 64]), rng.randrange(20, 401)
        x = torch.randn(batch, length, 256, generator=g).to(dev)
        opt.zero_grad(set_to_none=True)
        out, _ = model(x)
        loss = torch.nn.functional.mse_loss(head(out), x)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return _timed(rounds, body), "cuDNN LSTM (3 layers, 1024 hidden), Adam, batch 32..64, lengths 20..400"


def reduce_overhead(rounds):
    import torch

    from models import TinyGPT, next_token_loss

    dev = torch.device("cuda:0")
    vocab = 8192
    model = TinyGPT(vocab=vocab, dim=512, layers=4, heads=8).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    @torch.compile(mode="reduce-overhead")
    def forward_loss(tokens):
        logits = model(tokens)
        return next_token_loss(logits, tokens)

    rng, g = _draws(31)

    def body(i):  # three sequence buckets: three CUDA graphs in private pools
        tokens = torch.randint(0, vocab, (16, rng.choice([128, 256, 512])), generator=g).to(dev)
        torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(tokens)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return _timed(rounds, body), "torch.compile(mode='reduce-overhead') TinyGPT (4 layers), AdamW, lengths 128/256/512"


def serve_varbatch(rounds):
    import torch
    import torchvision

    dev = torch.device("cuda:0")
    model = torchvision.models.resnet50(num_classes=1000).to(dev, torch.float16).eval()
    rng, g = _draws(37)

    def body(i):  # one round: 16 requests of random batch sizes and resolutions
        total = 0.0
        with torch.inference_mode():
            for _ in range(16):
                b, s = rng.randrange(1, 257), rng.choice([160, 192, 224, 256, 288])
                x = torch.randn(b, 3, s, s, generator=g).to(dev, torch.float16)
                total += float(model(x).float().sum())
        return total

    return _timed(rounds, body), "torchvision resnet50 fp16 inference, 16 requests a round of batch 1..256, 160..288 px"


def cudnn_benchmark(rounds):
    import torch
    import torchvision

    dev = torch.device("cuda:0")
    torch.backends.cudnn.benchmark = True  # each new shape is timed, and cuDNN empties the cache after
    model = torchvision.models.resnet50(num_classes=100).to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng, g = _draws(41)

    def body(i):
        s = rng.choice([160, 192, 224, 256, 288, 320])
        x = torch.randn(48, 3, s, s, generator=g).to(dev).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 100, (48,), generator=g).to(dev)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return _timed(rounds, body), ("torchvision resnet50, cudnn.benchmark (cuDNN empties the cache after timing each "
                                  "new shape), bf16, batch 48, random sizes 160..320")


def graph_branches(rounds):
    import torch

    from models import TinyGPT, next_token_loss

    dev = torch.device("cuda:0")
    vocab = 8192
    body_model = TinyGPT(vocab=vocab, dim=512, layers=4, heads=8).to(dev)
    head = torch.nn.Sequential(torch.nn.Linear(vocab, 512), torch.nn.GELU(), torch.nn.Linear(512, vocab)).to(dev)
    opt = torch.optim.AdamW(list(body_model.parameters()) + list(head.parameters()), lr=1e-4)
    encode = torch.compile(body_model, mode="reduce-overhead")
    refine = torch.compile(head, mode="reduce-overhead", dynamic=False)
    rng, g = _draws(43)

    def body(i):  # a fixed-shape graph, then one of three: new branches of one tree
        tokens = torch.randint(0, vocab, (8, 256), generator=g).to(dev)
        keep = rng.choice([64, 128, 256])
        torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        logits = refine(encode(tokens)[:, :keep])
        loss = next_token_loss(logits, tokens)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return _timed(rounds, body), ("two torch.compile(mode='reduce-overhead') graphs a step, the second on one of "
                                  "three lengths: cudagraph trees branch and restore checkpoints of their pool")


def fsdp(rounds):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    cfg = GPT2Config(n_positions=512, n_embd=768, n_layer=12, n_head=12)
    model = GPT2LMHeadModel(cfg).to(dev)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng, g = _draws(41)

    def body(i):
        ids = torch.randint(0, cfg.vocab_size, (8, rng.randrange(64, 513)), generator=g).to(dev)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    try:
        return _timed(rounds, body), ("FSDP2 fully_shard (1 process, NCCL) GPT-2 small, bf16 params, fp32 reduce, "
                                      "gradient checkpointing, AdamW, batch 8, lengths 64..512")
    finally:
        dist.destroy_process_group()


def multi_stream(rounds):
    import torch
    from torch import nn

    from models import CSPBlock, conv_bn

    dev = torch.device("cuda:0")

    class Branches(nn.Module):
        def __init__(self, n=4, w=64):
            super().__init__()
            self.stem = conv_bn(3, w, 3, 2)
            self.branches = nn.ModuleList(
                nn.Sequential(conv_bn(w, w * (k + 1), 3, 2), CSPBlock(w * (k + 1), k + 1), nn.AdaptiveAvgPool2d(1))
                for k in range(n))
            self.streams = [torch.cuda.Stream() for _ in range(n)]
            self.head = nn.Linear(sum(w * (k + 1) for k in range(n)), 100)

        def forward(self, x):
            x = self.stem(x)
            main = torch.cuda.current_stream()
            outs = []
            for branch, s in zip(self.branches, self.streams):
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    x.record_stream(s)
                    outs.append(branch(x).flatten(1))
            for s, o in zip(self.streams, outs):
                main.wait_stream(s)
                o.record_stream(main)
            return self.head(torch.cat(outs, 1))

    model = Branches().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rng, g = _draws(43)

    def body(i):
        size = rng.choice([160, 192, 224, 256, 288, 320])
        x = torch.randn(64, 3, size, size, generator=g).to(dev)
        y = torch.randint(0, 100, (64,), generator=g).to(dev)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return _timed(rounds, body), "four CNN branches on four streams (forward and backward), batch 64, sizes 160..320"


def moe(rounds):
    import torch
    import torch.nn.functional as F
    from models import next_token_loss
    from torch import nn

    dev = torch.device("cuda:0")
    dim, heads, experts, vocab = 768, 12, 8, 32000

    class Experts(nn.Module):
        """Top-2 routing over eight expert MLPs, each run on the rows routed
        to it (gathered by index, scattered back with index_add_)."""

        def __init__(self):
            super().__init__()
            self.router = nn.Linear(dim, experts, bias=False)
            self.up = nn.ModuleList(nn.Linear(dim, 4 * dim) for _ in range(experts))
            self.down = nn.ModuleList(nn.Linear(4 * dim, dim) for _ in range(experts))

        def forward(self, x):
            flat = x.reshape(-1, dim)
            weight, chosen = torch.topk(self.router(flat).float().softmax(-1), 2, dim=-1)
            out = torch.zeros(flat.shape, device=flat.device, dtype=torch.float32)
            for e in range(experts):
                rows, slot = (chosen == e).nonzero(as_tuple=True)
                if rows.numel():
                    y = self.down[e](F.gelu(self.up[e](flat[rows])))
                    out.index_add_(0, rows, y.float() * weight[rows, slot, None])
            return out.reshape(x.shape)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.experts = Experts()

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, dim)
            x = x + self.proj(a)
            return x + self.experts(self.n2(x))

    class Model(nn.Module):
        def __init__(self, layers=6):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    torch.manual_seed(47)
    model = Model().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    rng, g = _draws(47)

    def body(i):
        tokens = torch.randint(0, vocab, (8, rng.randrange(64, 1025)), generator=g).to(dev)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens)
            loss = next_token_loss(logits, tokens)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return _timed(rounds, body), "mixture of experts (6 layers, 8 experts, top-2), AdamW, bf16 autocast, batch 8, lengths 64..1024"


def gnn(rounds):
    import torch
    import torch.nn.functional as F
    from torch_geometric.nn import GCNConv, SAGEConv

    dev = torch.device("cuda:0")

    class Net(torch.nn.Module):
        def __init__(self, features=128, hidden=256, classes=40):
            super().__init__()
            self.convs = torch.nn.ModuleList(
                [SAGEConv(features, hidden), SAGEConv(hidden, hidden), GCNConv(hidden, hidden)])
            self.out = torch.nn.Linear(hidden, classes)

        def forward(self, x, edge_index):
            for conv in self.convs:
                x = F.relu(conv(x, edge_index))
            return self.out(x)

    torch.manual_seed(53)
    model = Net().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng, g = _draws(53)

    def body(i):
        n = rng.randrange(20_000, 200_001)
        e = n * rng.randrange(5, 21)
        x = torch.randn(n, 128, generator=g).to(dev)
        edges = torch.randint(0, n, (2, e), generator=g).to(dev)
        y = torch.randint(0, 40, (n,), generator=g).to(dev)
        return _train_step(opt, lambda: F.cross_entropy(model(x, edges), y))

    return _timed(rounds, body), "torch_geometric SAGE+GCN (3 layers), Adam, a random graph a step: 20k..200k nodes, 5..20 edges a node"


def lora(rounds):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = torch.device("cuda:0")
    torch.manual_seed(59)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=1024)
    base = LlamaForCausalLM(cfg).to(dev, dtype=torch.bfloat16)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    rng, g = _draws(59)

    def body(i):
        lengths = [rng.randrange(64, 1025) for _ in range(8)]
        width = max(lengths)
        ids = torch.randint(0, cfg.vocab_size, (8, width), generator=g)
        mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        return _train_step(opt, lambda: model(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                              labels=labels.to(dev)).loss)

    return _timed(rounds, body), ("peft LoRA r=16 over a frozen bf16 Llama (8 layers, width 1024), gradient "
                                  "checkpointing, AdamW, batch 8 padded to its longest of 64..1024 tokens")


def accelerate_amp(rounds):
    import timm
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=4)
    torch.manual_seed(61)
    model = timm.create_model("convnext_tiny", num_classes=100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    rng, g = _draws(61)

    def body(i):
        losses = []
        for _ in range(4):
            size = rng.choice(range(160, 289, 32))
            x = torch.randn(32, 3, size, size, generator=g).to(accelerator.device)
            y = torch.randint(0, 100, (32,), generator=g).to(accelerator.device)
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        return sum(losses) / len(losses)

    return _timed(rounds, body), ("accelerate (bf16, 4 accumulated micro-batches, clipping) timm convnext_tiny, "
                                  "batch 32, a random size of 160..288 px each micro-batch")


def speech_ctc(rounds):
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    dev = torch.device("cuda:0")
    torch.manual_seed(67)
    cfg = Wav2Vec2Config(vocab_size=32, pad_token_id=0, layerdrop=0.0, mask_time_prob=0.0,
                         ctc_loss_reduction="mean", ctc_zero_infinity=True)
    model = Wav2Vec2ForCTC(cfg).to(dev)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng, g = _draws(67)

    def body(i):
        samples = rng.randrange(16_000, 192_001)
        audio = torch.randn(8, samples, generator=g)
        lengths = [rng.randrange(5, 1 + min(60, samples // 640)) for _ in range(8)]
        labels = torch.full((8, max(lengths)), -100, dtype=torch.long)
        for row, n in enumerate(lengths):
            labels[row, :n] = torch.randint(1, cfg.vocab_size, (n,), generator=g)
        return _train_step(opt, lambda: model(input_values=audio.to(dev), labels=labels.to(dev)).loss,
                           torch.bfloat16)

    return _timed(rounds, body), ("transformers Wav2Vec2ForCTC (base), AdamW, bf16 autocast, batch 8, "
                                  "raw audio of 1..12 s, CTC targets of 5..60 labels")


def t5_adafactor(rounds):
    import torch
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.optimization import Adafactor

    dev = torch.device("cuda:0")
    torch.manual_seed(71)
    cfg = T5Config(vocab_size=32128, d_model=512, d_ff=2048, num_layers=6, num_heads=8,
                   decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)
    model = T5ForConditionalGeneration(cfg).to(dev)
    model.train()
    opt = Adafactor(model.parameters(), lr=None, scale_parameter=True, relative_step=True, warmup_init=True)
    rng, g = _draws(71)

    def body(i):
        src = torch.randint(1, cfg.vocab_size, (16, rng.randrange(64, 513)), generator=g)
        tgt = torch.randint(1, cfg.vocab_size, (16, rng.randrange(8, 129)), generator=g)
        return _train_step(opt, lambda: model(input_ids=src.to(dev), labels=tgt.to(dev)).loss, torch.bfloat16)

    return _timed(rounds, body), ("transformers T5 (small), Adafactor with relative steps, bf16 autocast, batch 16, "
                                  "sources of 64..512 and targets of 8..128 tokens")


# name -> (function, rounds)
WORKLOADS = {
    "generate": (generate, 8),
    "empty_cache": (empty_cache, 30),
    "checkpoint_amp": (checkpoint_amp, 40),
    "vit_amp": (vit_amp, 40),
    "compile_dynamic": (compile_dynamic, 30),
    "faster_rcnn": (faster_rcnn, 30),
    "side_stream": (side_stream, 40),
    "lstm_varlen": (lstm_varlen, 40),
    "reduce_overhead": (reduce_overhead, 40),
    "serve_varbatch": (serve_varbatch, 12),
    "cudnn_benchmark": (cudnn_benchmark, 40),
    "graph_branches": (graph_branches, 30),
    "fsdp": (fsdp, 30),
    "multi_stream": (multi_stream, 40),
    "moe": (moe, 40),
    "gnn": (gnn, 40),
    "lora": (lora, 40),
    "accelerate": (accelerate_amp, 30),
    "speech_ctc": (speech_ctc, 40),
    "t5_adafactor": (t5_adafactor, 40),
}


def child(name, alloc):
    import checks

    payload = {"check": name}
    try:
        global PROFILER
        PROFILER = StepProfiler(os.environ.get("GPUALLOC_SWEEP_PROFILE_ROUNDS"))
        payload["setup"] = checks.setup(alloc)
        checks._deterministic()
        import torch

        floor = [checks._host_floor_us(torch)]
        fn, rounds = WORKLOADS[name]
        (times, outs), what = fn(rounds)
        floor.append(checks._host_floor_us(torch))

        warm = times[max(1, rounds // 5):]
        payload["result"] = {
            "model": what,
            "round_ms": [round(t * 1e3, 2) for t in times],
            "mean_s_all": statistics.fmean(times),
            "median_s": statistics.median(warm),
            "outputs": outs,
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "peak_reserved": torch.cuda.max_memory_reserved(),
            "counters": checks._counters(),
            "host_floor_us": floor,
        }
        payload["result"].update(PROFILER.report())
    except Exception as e:  # noqa: BLE001
        import traceback

        payload["error"] = f"{type(e).__name__}: {e}"
        payload["traceback"] = traceback.format_exc()[-3000:]
    checks.result(payload)


def paired_ratio(runs, workload, variant, ref):
    """The median over repeats of `variant`'s time over `ref`'s in the same
    repeat, summed over the rounds both ran after the first fifth: the
    workloads draw the same shapes round by round, so rounds pair, and a
    repeat pairs two processes run one after the other. None without a
    reference or a repeat where both finished."""
    if ref is None or ref == variant:
        return None

    def rounds(v, rep):
        return next((r["result"]["round_ms"] for r in runs if r["workload"] == workload and r["variant"] == v
                     and r.get("repeat", 0) == rep and "round_ms" in r.get("result", {})), None)

    ratios = []
    for rep in sorted({r.get("repeat", 0) for r in runs if r["workload"] == workload}):
        a, b = rounds(variant, rep), rounds(ref, rep)
        if a and b:
            n = min(len(a), len(b))
            start = max(1, n // 5)
            if sum(b[start:n]) > 0:
                ratios.append(sum(a[start:n]) / sum(b[start:n]))
    return statistics.median(ratios) if ratios else None


def host_notes(runs, workloads):
    """A note for each repeat whose processes of one workload ran at host
    speeds (`host_floor_us`) more than driver.HOST_SPEED_TOLERANCE apart
    (driver.speeds_apart):
    their host-bound rounds cannot rank the allocators."""
    notes = []
    for w in workloads:
        for rep in sorted({r.get("repeat", 0) for r in runs if r["workload"] == w}):
            floors = {r["variant"]: driver.host_floor(r["result"]) for r in runs
                      if r["workload"] == w and r.get("repeat", 0) == rep and "result" in r}
            floors = {v: f for v, f in floors.items() if f}
            if driver.speeds_apart(floors.values()):
                each = ", ".join(f"{v} {f:.2f} µs" for v, f in floors.items())
                notes.append(f"{w}, repeat {rep}: host speeds differ ({each}); its host-bound rounds cannot rank the allocators")
    return notes


def summarize(runs, workloads, variants):
    rows = ["| workload | variant | runs | R/A | mean, all rounds (ms) | median (ms) | mean / faster native | median / faster native "
            "| outputs vs native (max rel. diff) | num_device_alloc | rounds / faster native, paired | host µs |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        ok = {v: [r["result"] for r in runs if r["workload"] == w and r["variant"] == v and "result" in r] for v in variants}
        means = {v: statistics.median(x["mean_s_all"] for x in ok[v]) for v in variants if ok[v]}
        medians = {v: statistics.median(x["median_s"] for x in ok[v]) for v in variants if ok[v]}
        faster = min((n for n in NATIVE if n in means), key=means.get, default=None)
        base = means.get(faster)
        base_median = min((medians[v] for v in NATIVE if v in medians), default=None)
        ref = next((ok[v][0]["outputs"] for v in NATIVE if ok.get(v)), None)

        def diff(outs):
            d = [abs(a - b) / max(1e-12, abs(a)) for a, b in zip(ref, outs)]
            return max(d) if d and len(outs) == len(ref) else float("inf")

        for v in variants:
            failed = [r for r in runs if r["workload"] == w and r["variant"] == v and "result" not in r]
            if not ok[v]:
                err = failed[0].get("error", "?") if failed else "not run"
                rows.append(f"| {w} | {v} | 0 | failed: {str(err)[:80]} | | | | | | | | |")
                continue
            ra = statistics.median(x["peak_reserved"] / max(1, x["peak_allocated"]) for x in ok[v])
            med = medians[v] * 1e3
            rel = f"{means[v] / base:.3f}" if base else "–"
            rel_median = f"{medians[v] / base_median:.3f}" if base_median else "–"
            same = "–" if ref is None else f"{max(diff(x['outputs']) for x in ok[v]):.1e}"
            dev = ok[v][0]["counters"].get("num_device_alloc")
            paired = paired_ratio(runs, w, v, faster)
            floors = [f for f in (driver.host_floor(x) for x in ok[v]) if f]
            host = f"{statistics.median(floors):.2f}" if floors else "–"
            rows.append(f"| {w} | {v} | {len(ok[v])}{f' ({len(failed)} failed)' if failed else ''} | {ra:.3f} | "
                        f"{means[v] * 1e3:.1f} | {med:.1f} | {rel} | {rel_median} | {same} | {dev} | "
                        f"{'–' if paired is None else f'{paired:.3f}'} | {host} |")
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help=f"workloads, of {','.join(WORKLOADS)} (default: all)")
    p.add_argument("--variants", default="native,native-expandable,gpualloc")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--budget", type=float, default=540.0, help="seconds; runs that no longer fit are skipped")
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "ALLOC"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(*args.child)
    workloads = [w for w in WORKLOADS if not args.only or w in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - set(WORKLOADS)
    if unknown or not workloads:
        p.error(f"--only takes {','.join(WORKLOADS)} (got {args.only!r})")
    try:
        variants = driver.parse_variants(args.variants)
    except ValueError as e:
        p.error(str(e))
    uses_gpualloc = driver.require_library(variants)
    logdir = os.path.join(args.out, "sweep-logs")
    os.makedirs(logdir, exist_ok=True)
    # The bridge is compiled once here, not inside the first run's time limit.
    bridge = driver.build_bridge(logdir) if uses_gpualloc else None
    t0, runs, skipped, longest = time.time(), [], [], {}
    for rep in range(args.repeats):
        order = driver.run_order(variants, rep)
        for w in workloads:
            for v in order:
                left = args.budget - (time.time() - t0)
                if left < max(20.0, longest.get(w, 0.0)):
                    skipped.append(f"{w} {v} repeat {rep}")
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--child", w, driver.variant(v)[0]]
                r = driver.run_child(cmd, v, min(TIMEOUT_S, left), logdir, f"{w}-{v}-{rep}",
                                     driver.trace_path(logdir, w, v))
                longest[w] = max(longest.get(w, 0.0), r["wall_s"])
                runs.append({"workload": w, "variant": v, "repeat": rep, **r})
                status = "ok" if "result" in r else r.get("error", "failed")
                print(f"{w} {v} repeat {rep}: {status} ({r['wall_s']} s)", flush=True)
    md = "## Sweep\n\n" + summarize(runs, workloads, variants)
    for note in driver.order_notes(runs, workloads, variants, lambda r: "result" in r) + host_notes(runs, workloads):
        md += "\n\n" + note
    if skipped:
        md += "\n\nSkipped (budget): " + ", ".join(skipped)
    if bridge and bridge["mode"] != "bridge":
        md += f"\n\ngpualloc installed without its bridge (mode {bridge['mode']}): see sweep-logs/bridge-build.log"
    driver.write_results(args.out, "sweep", md, {"runs": runs, "skipped": skipped, "bridge_build": bridge,
                                                 "total_s": round(time.time() - t0, 1)})


if __name__ == "__main__":
    main()
