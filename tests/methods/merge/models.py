"""The tiny ViTs token merging is tested on, one per supported layout."""

from __future__ import annotations

import torch

from tests._helpers import hf_models as H
from tests.hf.test_timm_layout import VisionTransformer

transformers = H.transformers

FAMILIES = ("vit", "deit", "dinov2", "dinov2_registers", "timm")
#: Protected tokens at the start of each family's sequence.
PREFIX = {"vit": 1, "deit": 2, "dinov2": 1, "dinov2_registers": 5, "timm": 1}


def build(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny, randomly initialised model of ``family``, in eval mode."""
    torch.manual_seed(seed)
    if family == "timm":
        model = VisionTransformer()
    elif family == "dinov2_registers":
        config = transformers.Dinov2WithRegistersConfig(
            **{k: v for k, v in H.config("dinov2").to_dict().items() if k in _DINO_KEYS},
            num_register_tokens=4,
        )
        model = transformers.Dinov2WithRegistersModel(config)
    else:
        model = H.build(next(f for f in H.FAMILIES if f.name == family), seed)
    if family != "timm":
        # weights away from their initial values, so layer scales and biases matter
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    return model.eval()


_DINO_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "image_size",
    "patch_size",
    "mlp_ratio",
)


def run(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The model's token output: ``last_hidden_state``, or timm's normed tokens."""
    with torch.no_grad():
        if hasattr(model, "config"):
            return model(pixel_values=images).last_hidden_state
        x = model.patch_embed(images)
        x = torch.cat([model.cls_token.expand(len(x), -1, -1), x], dim=1) + model.pos_embed
        return model.norm(model.blocks(x))


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.blocks) if not hasattr(model, "config") else list(_hf_layers(model))


def _hf_layers(model):
    from toast.hf.model.blocks import find_blocks

    return find_blocks(model).blocks


def block_io(model: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states entering the first block and leaving the last one."""
    seen = {}

    def entering(module, args, kwargs):
        seen["in"] = args[0] if args else kwargs["hidden_states"]

    def leaving(module, args, out):
        seen["out"] = out

    first, last = blocks(model)[0], blocks(model)[-1]
    hooks = [
        first.register_forward_pre_hook(entering, with_kwargs=True),
        last.register_forward_hook(leaving),
    ]
    try:
        run(model, images)
    finally:
        for h in hooks:
            h.remove()
    return seen["in"], seen["out"]
