"""timm-style vision transformers: blocks in an ``nn.Sequential`` whose
forward chains them, each taking and returning a (batch, tokens, dim) tensor.

The model below is laid out exactly as timm's ``VisionTransformer``
(``patch_embed.proj``, ``cls_token``, ``pos_embed``, ``blocks`` = Sequential
of ``Block`` with ``norm1``, ``attn.qkv``, ``attn.proj``, ``norm2``,
``mlp.fc1``, ``mlp.fc2``, then ``norm`` and ``head``): timm itself imports
torchvision, and PyPI's torchvision 0.28.0 (pinned to torch 2.13.0) fails to
import beside torch 2.13.0+cpu ("operator torchvision::nms does not exist").
The last test runs timm's own model where timm imports.
"""

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import toast  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

DIM, DEPTH, HEADS, IMAGE, PATCH = 32, 6, 4, 16, 4


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.num_heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        x = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), Mlp(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, PATCH, PATCH)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(nn.Module):
    def __init__(self, dim=DIM, depth=DEPTH, heads=HEADS, classes=10):
        super().__init__()
        self.patch_embed = PatchEmbed(dim)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def _model():
    torch.manual_seed(0)
    return VisionTransformer().eval()


def _images(n=64, batch=16):
    x = torch.randn(n, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1))
    return [x[i : i + batch] for i in range(0, n, batch)]


def test_the_sequential_of_blocks_and_the_final_norm_are_found():
    model = _model()
    stack = toast.hf.find_blocks(model)
    assert stack.path == "blocks" and stack.num_blocks == DEPTH
    assert stack.final_norm is model.norm


def test_analysis_of_a_timm_layout_gives_every_span():
    analysis = toast.analyze(_model(), _images(), estimator="gcv", progress=False)
    assert analysis.errors.shape == (DEPTH + 1, DEPTH + 1)
    assert analysis.rows == 64 * 17  # every patch token and the CLS token


def test_compression_keeps_a_sequential_that_runs():
    model = _model()
    x = _images()[0]
    before = model(x)
    model, report = toast.compress(model, _images(), budget=2, progress=False)
    assert isinstance(model.blocks, nn.Sequential)
    assert len(model.blocks) == DEPTH - report.blocks_removed + len(report.spans)
    after = model(x)
    assert after.shape == before.shape and torch.isfinite(after).all()


def test_a_translator_fitted_on_identical_blocks_reproduces_the_output():
    # Blocks made to compute the identity: any span is replaced exactly.
    model = _model()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.proj.weight.zero_(), block.attn.proj.bias.zero_()
            block.mlp.fc2.weight.zero_(), block.mlp.fc2.bias.zero_()
    x = _images()[0]
    before = model(x)
    model, _ = toast.compress(model, _images(), spans=[(1, 4)], translator="affine", progress=False)
    torch.testing.assert_close(model(x), before, atol=1e-4, rtol=1e-4)


def test_timm_vision_transformer_itself():
    timm = pytest.importorskip("timm")  # imports torchvision: see the module docstring
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=32,
        patch_size=8,
        depth=4,
        num_classes=10,
    ).eval()
    x = torch.randn(32, 3, 32, 32)
    model, report = toast.compress(model, [x[:16], x[16:]], budget=1, progress=False)
    assert isinstance(model.blocks, nn.Sequential) and report.blocks_removed == 1
    assert model(x[:2]).shape == (2, 10)
