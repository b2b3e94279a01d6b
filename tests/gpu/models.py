"""Models for the GPU training checks (plain PyTorch, nothing downloaded)."""

import torch
from torch import nn


def next_token_loss(logits, tokens):
    """Cross-entropy of each position's logits (in float32) against the token
    that follows it; `tokens` may be longer than the logits' sequence."""
    t, vocab = logits.shape[1], logits.shape[-1]
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), tokens[:, 1:t].reshape(-1))


def conv_bn(cin, cout, k=3, s=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout), nn.SiLU())


class CSPBlock(nn.Module):
    """A cross-stage-partial block: half the channels go through n residual convs."""

    def __init__(self, c, n):
        super().__init__()
        h = c // 2
        self.a = conv_bn(c, h, 1)
        self.b = conv_bn(c, h, 1)
        self.m = nn.Sequential(*[nn.Sequential(conv_bn(h, h, 1), conv_bn(h, h, 3)) for _ in range(n)])
        self.out = conv_bn(2 * h, c, 1)

    def forward(self, x):
        return self.out(torch.cat([self.m(self.a(x)), self.b(x)], 1))


class MultiScaleDetector(nn.Module):
    """A small YOLO-like detector: CSP backbone, top-down FPN, three heads (strides 8, 16, 32)."""

    def __init__(self, classes=20, width=64):
        super().__init__()
        w = width
        self.stem = nn.Sequential(conv_bn(3, w // 2, 3, 2), conv_bn(w // 2, w, 3, 2), CSPBlock(w, 1))
        self.s8 = nn.Sequential(conv_bn(w, 2 * w, 3, 2), CSPBlock(2 * w, 2))
        self.s16 = nn.Sequential(conv_bn(2 * w, 4 * w, 3, 2), CSPBlock(4 * w, 3))
        self.s32 = nn.Sequential(conv_bn(4 * w, 8 * w, 3, 2), CSPBlock(8 * w, 1))
        self.lat32 = conv_bn(8 * w, 4 * w, 1)
        self.fuse16 = CSPBlock(8 * w, 1)
        self.lat16 = conv_bn(8 * w, 2 * w, 1)
        self.fuse8 = CSPBlock(4 * w, 1)
        out = 5 + classes
        self.head8 = nn.Conv2d(4 * w, out, 1)
        self.head16 = nn.Conv2d(8 * w, out, 1)
        self.head32 = nn.Conv2d(8 * w, out, 1)

    def forward(self, x):
        x = self.stem(x)
        p8 = self.s8(x)
        p16 = self.s16(p8)
        p32 = self.s32(p16)
        up16 = nn.functional.interpolate(self.lat32(p32), size=p16.shape[-2:], mode="nearest")
        f16 = self.fuse16(torch.cat([up16, p16], 1))
        up8 = nn.functional.interpolate(self.lat16(f16), size=p8.shape[-2:], mode="nearest")
        f8 = self.fuse8(torch.cat([up8, p8], 1))
        return [self.head8(f8), self.head16(f16), self.head32(p32)]


class FeatureHeads(nn.Module):
    """A feature backbone (returning a list or a dict of maps, finest first)
    with a 1x1 dense head on each of its last three maps."""

    def __init__(self, features, channels, out=25):
        super().__init__()
        self.features = features
        self.heads = nn.ModuleList(nn.Conv2d(c, out, 1) for c in channels[-3:])

    def forward(self, x):
        maps = self.features(x)
        maps = list(maps.values()) if isinstance(maps, dict) else maps
        return [head(m) for head, m in zip(self.heads, maps[-3:])]


class TinyGPT(nn.Module):
    """A GPT-2-shaped decoder (used only when transformers is not installed)."""

    def __init__(self, vocab, dim, layers, heads, max_len=1024):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        h = self.blocks(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))
