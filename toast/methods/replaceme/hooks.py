"""Hooks of ReplaceMe's calibration passes: the MLP output ``M`` of the
blocks that receive a transform, the check that it can be folded, and
calibration forwards without a KV cache.

Shopkhoev et al., "ReplaceMe" (arXiv 2505.02819), §3 assumes a pre-norm
block ``L = Y + MLP(Y)``: only then does a transform of ``M`` reach the
block's output unchanged, so that folding it into the down-projection is
exact. :class:`MlpOutputs` checks that on the first batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from toast.hf.model.blocks import BlockStack
from toast.methods.replaceme.fold import NotFoldableError, Writer, residual_writer

__all__ = ["MlpOutputs", "NotFoldableError", "no_kv_cache"]


def _is_cache(value: Any) -> bool:
    return any(cls.__name__ == "Cache" for cls in type(value).__mro__)


def _first_tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


@contextlib.contextmanager
def no_kv_cache(model: nn.Module) -> Iterator[None]:
    """Calibration forwards build no KV cache (``config.use_cache = False``
    for the duration; restored after)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "use_cache", None) is None:
        yield
        return
    previous = config.use_cache
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = previous


class MlpOutputs:
    """Forward hooks keeping the last batch's MLP output ``M`` of some blocks,
    and a one-off check that each block's output is ``Y + M`` (so that a
    transform of ``M`` can be folded into the down-projection). A batch the
    block-by-block path runs a few rows at a time
    (:attr:`toast.hf.capture.disk_model.DiskModel.rows_at_once`) calls the
    MLP once per run of rows: :meth:`take` joins them."""

    def __init__(self, stack: BlockStack, kept: Sequence[int], check: bool) -> None:
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self._probing = False
        self._checked: set[int] = set()
        self._handles: list[Any] = []
        for k in sorted(set(kept)):
            block = stack.blocks[k]
            writer = residual_writer(block)
            self._handles.append(writer.module.register_forward_hook(self._record(k)))
            if check:
                self._handles.append(
                    block.register_forward_hook(self._probe(k, writer), with_kwargs=True)
                )

    def _record(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._probing:
                self.outputs.setdefault(k, []).append(_first_tensor(output))

        return hook

    def _probe(self, k: int, writer: Writer) -> Callable[..., None]:
        def hook(block: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._probing or k in self._checked:
                return
            self._checked.add(k)
            self._check_fold(k, block, writer, args, kwargs, _first_tensor(output))

        return hook

    def _check_fold(
        self,
        k: int,
        block: nn.Module,
        writer: Writer,
        args: tuple,
        kwargs: dict,
        hidden: torch.Tensor,
    ) -> None:
        """Runs ``block`` again with a known vector added to its MLP output
        and raises :class:`NotFoldableError` unless the block's output moves
        by exactly that vector."""
        scale = float(hidden.detach().float().abs().max()) or 1.0
        delta = torch.linspace(-scale, scale, hidden.shape[-1], device=hidden.device)
        # Run the block again without any KV cache (it would be extended twice).
        again_args = tuple(None if _is_cache(a) else a for a in args)
        again_kwargs = {n: None if _is_cache(v) else v for n, v in kwargs.items()}
        if "use_cache" in again_kwargs:
            again_kwargs["use_cache"] = False

        def shift(module: nn.Module, a: tuple, out: torch.Tensor) -> torch.Tensor:
            return out + delta.to(out.dtype)

        handle = writer.module.register_forward_hook(shift)
        self._probing = True
        try:
            again = _first_tensor(block(*again_args, **again_kwargs))
        finally:
            handle.remove()
            self._probing = False
        moved = again.float() - hidden.float()
        # a 16-bit forward (the weights', or autocast's) rounds the shifted output
        narrow = torch.is_autocast_enabled(hidden.device.type)
        tol = 1e-3 if hidden.dtype in (torch.float32, torch.float64) and not narrow else 5e-2
        err = float((moved - delta).abs().max()) / scale
        if not err <= tol:
            raise NotFoldableError(
                f"block {k} ({type(block).__name__}): adding a vector to the output of "
                f"{writer.path} does not add it to the block's output (relative mismatch "
                f"{err:.3g}); a norm or another non-linear step follows the MLP (post-LN "
                "blocks, a post-feedforward norm toast did not find), so ReplaceMe's "
                "transform cannot be folded there. Use placement='block' for a separate "
                "transform instead"
            )

    def take(self, k: int) -> torch.Tensor:
        """The MLP output of block ``k`` since the last take (one batch's)."""
        if k not in self.outputs:
            raise RuntimeError(f"the MLP of block {k} did not run in this forward pass")
        runs = self.outputs.pop(k)
        return runs[0] if len(runs) == 1 else torch.cat(runs)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
