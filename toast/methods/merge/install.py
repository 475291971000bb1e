"""Installing token reduction on a model: :func:`enable_reduction` (any
reducer of :mod:`toast.methods.merge.reducers`), :func:`enable_merging`
(ToMe's) and :func:`disable_merging`.

Every reducing block's ``forward`` is replaced (an instance attribute, so
the block's modules, parameters and paths are unchanged and a save holds
the same tensors) by one that computes attention itself from the block's
modules, with proportional attention over the current token sizes, adds
it to the residual, asks the reducer which tokens to merge, prune or mix
(metric: the keys averaged over heads; the class token's attention row
when the reducer reads it), reduces them by size
(:func:`toast.methods.merge.matching.merge_tokens`; ``merge_norm`` sets a
merged token's norm), then runs the block's own ``mlp``.

State (token sizes and the source map, original token → current token)
lives for one forward: the first merging block starts it, the last one
ends it. With ``unmerge_output=True`` (the default) the last merging block
expands its output back to every input token (each token takes its merged
token's state), so the model's outputs keep their shapes
(``last_hidden_state`` is ``(B, N, D)``) and poolers, heads, a mean over
tokens (now the size-weighted mean) and patch features work unchanged;
blocks after it (e.g. a translator standing in for the last blocks) are
tokenwise, so where the expansion happens does not change the result.

Merging is inference-only: dropout and drop-path are not applied, and a
forward in training mode raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from toast.hf.capture.states import forward_inputs
from toast.hf.model.vit import TOKEN_MAP_ATTR
from toast.io.guard import guard_save
from toast.methods.merge.macs import merge_schedule
from toast.methods.merge.matching import (
    MERGE_NORMS,
    Matching,
    carry_source,
    merge_tokens,
    unmerge,
)
from toast.methods.merge.reducers import Reducer, TokenView, TomeReducer
from toast.methods.merge.sites import MergeSites, Site, find_sites

__all__ = [
    "HANDLE_ATTR",
    "MergeHandle",
    "disable_merging",
    "enable_merging",
    "enable_reduction",
    "measured_tokens",
    "merging_of",
]

#: The model attribute holding the installed handle (one per model).
HANDLE_ATTR = "_toast_merge"


@dataclass
class _Pass:
    """One forward's state: sizes ``(B, N, 1)`` (None: all 1) and the
    source map ``(B, N₀)`` (None: the identity)."""

    sizes: torch.Tensor | None = None
    source: torch.Tensor | None = None


@dataclass
class MergeHandle:
    """What :func:`enable_reduction` installed. ``reducer``: the rule each
    block asks (:mod:`toast.methods.merge.reducers`); ``tokens``: the token
    counts each site saw in the last forward (entering it, ``(in, after
    reducing)``); ``sizes`` / ``source``: the last forward's final sizes
    and source map (None: nothing reduced)."""

    model: nn.Module
    sites: MergeSites
    reducer: Reducer
    proportional_attention: bool = True
    unmerge_output: bool = True
    merge_norm: str = "average"
    tokens: list[tuple[int, int]] = field(default_factory=list)
    sizes: torch.Tensor | None = None
    source: torch.Tensor | None = None
    _pass: _Pass | None = None

    @property
    def r(self) -> tuple[int, ...]:
        """ToMe's merges per site (``AttributeError`` for other reducers)."""
        r: tuple[int, ...] = getattr(self.reducer, "r")  # noqa: B009  (the reducer's own field)
        return r

    def disable(self) -> None:
        """Puts every block's own forward back."""
        for site in self.sites.sites:
            vars(site.block).pop("forward", None)
        if getattr(self.model, HANDLE_ATTR, None) is self:
            delattr(self.model, HANDLE_ATTR)

    def state(self) -> dict[str, Any]:
        """The JSON-able description a save records (a ToMe state names no
        reducer, so it reads as saves before other reducers did)."""
        named = {} if self.reducer.name == "tome" else {"reducer": self.reducer.name}
        # the paper's average is left out, so such a save reads as before the option
        norm = {} if self.merge_norm == "average" else {"merge_norm": self.merge_norm}
        return {
            **named,
            **self.reducer.state(),
            **norm,
            "proportional_attention": self.proportional_attention,
            "unmerge_output": self.unmerge_output,
            "blocks": [s.path for s in self.sites.sites],
        }


class _MergingForward:
    """A reducing block's forward. A class, not a closure, so that
    ``copy.deepcopy(model)`` gets its own bound to the copied block."""

    def __init__(self, handle: MergeHandle, position: int) -> None:
        self.handle = handle
        self.position = position

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        h = self.handle
        site = h.sites.sites[self.position]
        mask = args[0] if args else kwargs.get("attention_mask")
        if mask is not None:
            raise ValueError("token reduction takes no attention mask (every image token is valid)")
        if site.block.training:
            raise RuntimeError(
                "token reduction is inference-only (no dropout, no drop-path): call model.eval()"
            )
        if self.position == 0 or h._pass is None:
            h._pass, h.tokens = _Pass(), []
        state = h._pass
        view = _attention_residual(site, hidden_states, state, h)
        x = view.x
        matching = h.reducer.reduce(self.position, view)
        if matching is not None:
            sizes = state.sizes if state.sizes is not None else torch.ones_like(x[..., :1])
            x, state.sizes = merge_tokens(x, sizes, matching, h.merge_norm)
            state.source = carry_source(state.source, matching)
        h.tokens.append((view.x.shape[1], x.shape[1]))
        x = _mlp_residual(site, x, matching)
        if self.position == len(h.sites.sites) - 1:
            x = _finish_pass(h, x)
        return x


def _attention_residual(site: Site, x: torch.Tensor, state: _Pass, h: MergeHandle) -> TokenView:
    """``x`` plus the block's attention (proportional to the token sizes
    when asked), with the merge metric (the keys averaged over heads) and,
    when the reducer asks, the first token's attention row."""
    norm1, _ = site.norms()
    scale1, _ = site.scales()
    q, k, v = site.qkv(norm1(x))
    _, _, scaling = site.heads()
    bias = None
    if h.proportional_attention and state.sizes is not None:
        bias = state.sizes.log().transpose(1, 2).unsqueeze(1).to(q.dtype)  # (B, 1, 1, N)
    context = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scaling)
    out = site.out(context)
    if scale1 is not None:
        out = scale1(out)
    cls_attention = None
    if h.reducer.needs_attention:
        logits = (q[:, :, :1] @ k.transpose(-1, -2)) * scaling  # (B, H, 1, N)
        if bias is not None:
            logits = logits + bias
        cls_attention = logits.softmax(dim=-1).mean(dim=1)[:, 0]
    return TokenView(k.mean(dim=1), x + out, state.sizes, cls_attention, h.sites.prefix)


def _mlp_residual(site: Site, x: torch.Tensor, matching: Matching | None) -> torch.Tensor:
    """``x`` plus the block's MLP (whatever module ``mlp`` is now), with the
    attention → MLP token map published for MLPs that read the attention
    (Token Channel Selection's CLS row)."""
    _, norm2 = site.norms()
    _, scale2 = site.scales()
    attention = site.attention
    # a callable: the dense shares of a pruning or mixing reduction cost a
    # (B, N', N) tensor, built only when an MLP reads the attention (TCS)
    setattr(attention, TOKEN_MAP_ATTR, None if matching is None else matching.token_map)
    try:
        out = site.block.mlp(norm2(x))
    finally:
        setattr(attention, TOKEN_MAP_ATTR, None)
    if scale2 is not None:
        out = scale2(out)
    return x + out


def _finish_pass(h: MergeHandle, x: torch.Tensor) -> torch.Tensor:
    """Ends the forward's state; expands ``x`` to every input token when asked."""
    state, h._pass = h._pass, None
    assert state is not None  # started by the first site of this forward
    h.sizes, h.source = state.sizes, state.source
    if h.unmerge_output and state.source is not None:
        return unmerge(x, state.source)
    return x


def enable_reduction(
    model: nn.Module,
    reducer: Reducer,
    *,
    proportional_attention: bool = True,
    unmerge_output: bool = True,
    merge_norm: str = "average",
    sites: MergeSites | None = None,
) -> MergeHandle:
    """Installs token reduction by ``reducer`` on ``model``, in place (see
    the module docstring); ``merge_norm``: a merged token's norm
    (:data:`~toast.methods.merge.matching.MERGE_NORMS`); ``sites``: the
    model's blocks when found already. Returns a :class:`MergeHandle`
    (``handle.disable()`` or :func:`disable_merging` undoes it)."""
    if merge_norm not in MERGE_NORMS:
        raise ValueError(f"merge_norm must be one of {MERGE_NORMS}; got {merge_norm!r}")
    found = find_sites(model) if sites is None else sites
    if getattr(model, HANDLE_ATTR, None) is not None:
        raise ValueError(
            "token reduction is already enabled on this model; call "
            "toast.methods.merge.disable_merging(model) first"
        )
    if reducer.num_blocks != found.num_blocks:
        raise ValueError(
            f"the {reducer.name} reducer is set for {reducer.num_blocks} blocks; the model has "
            f"{found.num_blocks}"
        )
    handle = MergeHandle(
        model, found, reducer, bool(proportional_attention), bool(unmerge_output), merge_norm
    )
    for position, site in enumerate(found.sites):
        site.block.forward = _MergingForward(handle, position)
    object.__setattr__(model, HANDLE_ATTR, handle)
    guard_save(model)  # model.save_pretrained now records the reduction
    return handle


def enable_merging(
    model: nn.Module,
    r: int | Sequence[int],
    *,
    schedule: str = "constant",
    proportional_attention: bool = True,
    unmerge_output: bool = True,
    merge_norm: str = "average",
    sites: MergeSites | None = None,
) -> MergeHandle:
    """Installs token merging on ``model``, in place (see the module docstring).

    ``r``: tokens merged per block, an int (spread by ``schedule``:
    ``"constant"``, ToMe's default, or ``"decreasing"``) or one count per
    block; ``r = 0`` everywhere leaves the outputs unchanged (to rounding).
    ``proportional_attention``: add ``log(size)`` to the attention logits
    (the paper's). ``unmerge_output``: expand the last block's output back
    to every input token. ``merge_norm``: a merged token's norm (``"average"``,
    the paper's; ``"max"``, Token Fusion's MLERP; ``"mean"``: see
    :data:`~toast.methods.merge.matching.MERGE_NORMS`). ``sites``: the
    model's blocks when found already. Returns a :class:`MergeHandle` (``handle.disable()`` or
    :func:`disable_merging` undoes it).
    """
    found = find_sites(model) if sites is None else sites
    reducer = TomeReducer(merge_schedule(r, found.num_blocks, schedule), schedule)
    return enable_reduction(
        model,
        reducer,
        proportional_attention=proportional_attention,
        unmerge_output=unmerge_output,
        merge_norm=merge_norm,
        sites=found,
    )


def merging_of(model: nn.Module) -> MergeHandle | None:
    """The handle of the merging installed on ``model`` (None: none)."""
    handle = getattr(model, HANDLE_ATTR, None)
    return handle if isinstance(handle, MergeHandle) else None


def disable_merging(model: nn.Module) -> bool:
    """Removes token merging from ``model``; returns whether it was enabled."""
    handle = merging_of(model)
    if handle is None:
        return False
    handle.disable()
    return True


def measured_tokens(
    model: nn.Module, sites: MergeSites, reducer: Reducer, example: Any, **options: Any
) -> tuple[tuple[float, float], ...]:
    """The tokens every block sees with ``reducer`` installed (with
    ``options`` of :func:`enable_reduction`), on ``example``: one forward,
    the model left as it was (the counts of a batch are the batch's; for
    reducers whose counts depend on the images)."""
    args, kwargs = forward_inputs(model, example)
    handle = enable_reduction(model, reducer, sites=sites, **options)
    try:
        with torch.inference_mode():
            model(*args, **kwargs)
        return tuple((float(n), float(kept)) for n, kept in handle.tokens)
    finally:
        handle.disable()
        assert merging_of(model) is None
