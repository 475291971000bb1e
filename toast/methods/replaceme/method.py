"""ReplaceMe: remove a contiguous span of blocks and replace it by a linear
transform folded into the down-projection of the last kept block.

Shopkhoev et al., *ReplaceMe: Network Simplification via Depth Pruning and
Transformer Block Linearization* (arXiv 2505.02819); notes with every
equation in ``papers/notes/002_replaceme.md``.

For a pre-norm block ``Y = X + Attn(X)``, ``M = MLP(Y)``, ``L = Y + M``. To
remove ``n`` blocks after block ``k``, ReplaceMe fits a ``d × d`` matrix T with
``M_k T + Y_k ≈ L_{k+n}`` and folds it into block ``k``'s MLP output
projection (``W ← Tᵀ W`` in torch's ``(out, in)`` layout, ``b ← b T``), so
the compressed model is a standard, smaller checkpoint of the same
architecture with no extra parameters.

Index conventions (toast's, see :mod:`toast.methods.toast.analysis`): state ``s`` is the
output of block ``s - 1`` (state 0 the embedding output), before the final
norm. A cut ``blocks[s:s+n]`` removes blocks ``s … s+n-1`` (0-based); the
transform goes into block ``s - 1``. The paper's ``i*`` (and the reference
code's profile row ``l``) is ``s - 1``, written ``l→l+n``; the reference
code's block tuple ``(start, end)`` is exactly ``(s, s+n)``.

Steps: :func:`profile_distances` (one pass: the distance between every pair
of states, e.g. the angular distance on the last non-pad token as the
reference code does), :meth:`DistanceProfile.select` (the window(s) of
smallest distance), then one more pass to estimate the transforms (``"ls"``:
float64 moments solved in closed form by the C core; ``"cosine"``: rows kept
in a disk-backed buffer and Adam or L-BFGS on the cosine loss), folding and
removal (:func:`toast.hf.surgery.remove_blocks`). :func:`replaceme` runs them all.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from toast.core import Moments, Translator, fit_translator
from toast.hf.blocks import BlockStack, Projection, _projections, block_parts, find_blocks
from toast.hf.capture import TOKENS, ForwardError, Tokens, select_tokens, stream_states
from toast.hf.params import count_params
from toast.hf.rows import RowSample, _human
from toast.hf.surgery import remove_blocks, replace_spans
from toast.hf.torch_moments import TorchMoments
from toast.spans import Span, validate_spans

__all__ = [
    "DISTANCES",
    "CosineFit",
    "DistanceProfile",
    "NotFoldableError",
    "ReplaceMeReport",
    "TransformedProjection",
    "compression_ratio",
    "fit_cosine",
    "fold_transform",
    "params_from_config",
    "profile_distances",
    "replaceme",
]

#: Distances between two states, averaged over rows: ``"angular"`` =
#: ``acos(cos)/π`` (the reference code), ``"cosine"`` = ``1 − cos`` (the
#: paper's text), ``"l2"`` = ``‖a − b‖`` (the paper's ablation, Fig. 5).
DISTANCES = ("angular", "cosine", "l2")
OBJECTIVES = ("ls", "cosine", "identity")
STRUCTURES = ("full", "diagonal", "orthogonal")
PLACEMENTS = ("fold", "mlp", "block")
_STRUCTURE_KIND = {"full": "linear", "diagonal": "diagonal", "orthogonal": "orthogonal"}
# Bytes of float64 row-pair scratch per chunk of the distance pass.
_PROFILE_CHUNK_BYTES = 64 * 2**20


# -- distance profile ---------------------------------------------------------


@dataclass
class DistanceProfile:
    """Mean distances between every pair of states of a model.

    ``distances[metric][i, j]`` (``i < j``) is the mean over calibration rows
    of the distance between state ``i`` and state ``j``, i.e. how much the
    blocks ``range(i, j)`` move a row; NaN on and below the diagonal.
    ``tokens`` says which rows were used (``"last"``: the last non-pad token
    of each sequence, the reference code's choice); ``rows`` how many;
    ``token_rows`` how many token rows the same data gives with every
    (non-pad) token, the rows a transform is estimated on.
    """

    distances: dict[str, np.ndarray] = field(repr=False)
    tokens: str
    rows: int
    block_path: str
    token_rows: int = 0

    @property
    def num_blocks(self) -> int:
        return self.distances[DISTANCES[0]].shape[0] - 1

    def matrix(self, metric: str = "angular") -> np.ndarray:
        """The ``(L + 1, L + 1)`` matrix of one metric."""
        if metric not in self.distances:
            raise ValueError(f"metric must be one of {DISTANCES}, got {metric!r}")
        return self.distances[metric]

    def windows(self, window: int, metric: str = "angular") -> np.ndarray:
        """Distances of every window of ``window`` blocks: entry ``s`` is the
        distance between states ``s`` and ``s + window`` (removing
        ``blocks[s:s+window]``), for ``s = 0 … L − window``."""
        window = _check_window(window, self.num_blocks)
        d = self.matrix(metric)
        return np.array([d[s, s + window] for s in range(self.num_blocks - window + 1)])

    def select(
        self,
        num_blocks: int,
        num_cuts: int = 1,
        *,
        metric: str = "angular",
        min_start: int = 1,
        adjacent: Literal["merge", "forbid"] = "merge",
    ) -> list[Span]:
        """The cut(s) removing ``num_blocks`` blocks, chosen by distance.

        One cut (Eq. 4): the window of ``num_blocks`` blocks of smallest
        distance. Several cuts (the paper's multi-LT): ``num_cuts`` windows
        of ``num_blocks / num_cuts`` blocks each, taken greedily in ascending
        distance among those that do not overlap the ones already taken (the
        reference's ``select_non_overlapping_blocks``). Adjacent windows are
        fused into one cut with one transform (``adjacent="merge"``, the
        reference's ``merge_consecutive``) or not allowed at all
        (``"forbid"``: a kept block between cuts, the paper's Multi_LT_nc).
        No window starts before block ``min_start`` (at least 1: the
        transform goes into the block before the cut). Returns spans sorted
        by position, each with the distance between its end states.
        """
        total = self.num_blocks
        num_cuts = _check_int("num_cuts", num_cuts, 1)
        num_blocks = _check_num_blocks(num_blocks, total)
        if num_blocks % num_cuts:
            raise ValueError(
                f"num_blocks={num_blocks} is not a multiple of num_cuts={num_cuts}: every cut "
                "removes num_blocks / num_cuts blocks"
            )
        if adjacent not in ("merge", "forbid"):
            raise ValueError(f"adjacent must be 'merge' or 'forbid', got {adjacent!r}")
        window = num_blocks // num_cuts
        min_start = _check_min_start(min_start, total, window)
        d = self.windows(window, metric)
        order = sorted(range(min_start, total - window + 1), key=lambda s: (d[s], s))
        chosen: list[int] = []
        gap = 1 if adjacent == "forbid" else 0
        for s in order:
            if len(chosen) == num_cuts:
                break
            if all(s + window + gap <= c or c + window + gap <= s for c in chosen):
                chosen.append(s)
        if len(chosen) < num_cuts:
            raise ValueError(
                f"cannot place {num_cuts} non-overlapping windows of {window} blocks"
                f"{' with a kept block between them' if adjacent == 'forbid' else ''} in "
                f"blocks {min_start}..{total - 1}; ask for fewer cuts or a lower min_start"
            )
        spans: list[tuple[int, int]] = []
        for s in sorted(chosen):
            if spans and spans[-1][1] == s:  # adjacent: "merge" (forbid never gets here)
                spans[-1] = (spans[-1][0], s + window)
            else:
                spans.append((s, s + window))
        m = self.matrix(metric)
        return [Span(a, b, float(m[a, b])) for a, b in spans]

    def to_csv(self, path: str | os.PathLike, window: int, metric: str = "angular") -> None:
        """Writes the reference code's ``layer_distances.csv`` (columns
        ``block_start, block_end, average_distance``; its block tuple equals
        toast's span ``(s, s + window)``)."""
        d = self.windows(window, metric)
        with open(path, "w", encoding="utf-8") as f:
            f.write("block_start,block_end,average_distance\n")
            for s, value in enumerate(d):
                f.write(f"{s},{s + window},{float(value)!r}\n")

    def plot(
        self,
        window: int,
        metric: str = "angular",
        *,
        cuts: Sequence[Span] = (),
        min_start: int = 1,
        ax: Any = None,
    ) -> Any:
        """Distance against window start (a line; starts before ``min_start``
        greyed, chosen cuts marked). Returns the matplotlib figure."""
        if ax is None:
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(7, 3.2))
        else:
            fig = ax.figure
        d = self.windows(window, metric)
        starts = np.arange(len(d))
        ax.plot(starts, d, marker="o", ms=3, lw=1.2, color="C0")
        if min_start > 0:
            ax.axvspan(-0.5, min_start - 0.5, color="0.85", label="not allowed (min_start)")
        for k, span in enumerate(cuts):
            if span.num_blocks == window:
                ax.plot(
                    span.start, d[span.start], "o", color="C3", ms=7, label=None if k else "cut"
                )
        ax.set_xlabel(f"first removed block s (window blocks[s:s+{window}])")
        ax.set_ylabel(f"{metric} distance")
        ax.set_title(
            f"ReplaceMe profile: {metric} distance, {self.tokens} tokens, {self.rows} rows"
        )
        ax.grid(alpha=0.3)
        if min_start > 0 or cuts:
            ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        return fig


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_num_blocks(num_blocks: Any, total: int) -> int:
    num_blocks = _check_int("num_blocks", num_blocks, 1)
    if num_blocks >= total:
        raise ValueError(
            f"num_blocks={num_blocks} must be below the model's depth ({total} blocks): "
            "at least one block stays before the cut"
        )
    return num_blocks


def _check_window(window: Any, total: int) -> int:
    window = _check_int("window", window, 1)
    if window > total:
        raise ValueError(f"window={window} exceeds the {total} blocks of the model")
    return window


def _check_min_start(min_start: Any, total: int, window: int) -> int:
    min_start = _check_int("min_start", min_start, 0)
    if min_start < 1:
        raise ValueError(
            "min_start must be >= 1: the transform is folded into the block before the cut, "
            "so block 0 is always kept"
        )
    if min_start > total - window:
        raise ValueError(
            f"min_start={min_start} is too large: a window of {window} blocks starting there "
            f"would end past the last block ({total} blocks; the latest start is "
            f"{total - window})"
        )
    return min_start


class _PairDistances:
    """Sums over rows of the distances between every pair of states."""

    def __init__(self, num_states: int) -> None:
        self.num_states = num_states
        self.sums = {m: np.zeros((num_states, num_states)) for m in DISTANCES}
        self.rows = 0

    def add(self, states: list[torch.Tensor], keep: torch.Tensor | None = None) -> None:
        """``states``: ``S`` tensors ``(rows, d)``; ``keep``: the indices of
        the rows to use (default all). Rows are taken a chunk at a time, so
        only one chunk of every state is ever copied."""
        S, d = len(states), int(states[0].shape[-1])
        rows = int(states[0].shape[0]) if keep is None else int(keep.numel())
        step = max(1, _PROFILE_CHUNK_BYTES // max(1, S * d * 8))
        for lo in range(0, rows, step):
            take = slice(lo, lo + step) if keep is None else keep[lo : lo + step]
            z = torch.stack([x[take] for x in states]).to(torch.float64)
            sq = (z * z).sum(-1)  # (S, r)
            gram = torch.einsum("ird,jrd->ijr", z, z)  # (S, S, r)
            norms = sq.sqrt()
            denom = norms[:, None] * norms[None, :]
            cos = torch.where(denom > 0, gram / denom.clamp_min(1e-300), torch.zeros_like(gram))
            cos = cos.clamp(-1.0, 1.0)
            sqdist = (sq[:, None] + sq[None, :] - 2.0 * gram).clamp_min(0.0)
            for name, value in (
                ("angular", torch.arccos(cos) / math.pi),
                ("cosine", 1.0 - cos),
                ("l2", sqdist.sqrt()),
            ):
                self.sums[name] += value.sum(-1).cpu().numpy()
        self.rows += rows

    def means(self) -> dict[str, np.ndarray]:
        upper = np.triu(np.ones((self.num_states, self.num_states), dtype=bool), k=1)
        return {m: np.where(upper, s / self.rows, np.nan) for m, s in self.sums.items()}


def profile_distances(
    model: nn.Module,
    loader: Iterable,
    *,
    tokens: Tokens = "last",
    include_padding: bool = False,
    blocks: str | None = None,
    max_batches: int | None = None,
    max_samples: int | None = None,
    sample: Literal["first", "random"] = "first",
    seed: int = 0,
    progress: bool = True,
) -> DistanceProfile:
    """One pass over ``loader``: the mean distance between every pair of states.

    States are the embedding output and every block's output, hooked on the
    blocks themselves, so the last state is taken *before* the final norm
    (``output_hidden_states`` of Llama-style models normalises it).
    ``tokens="last"`` (default) uses the last non-pad token of each sequence
    (the reference code); ``"all"`` every non-pad token (``include_padding``
    counts pad tokens too); ``"cls"`` and ``"mean"`` as in
    :func:`toast.capture_moments`. Every distance of :data:`DISTANCES` is
    accumulated in float64; the mean is over rows (sequences for ``"last"``).
    """
    if tokens not in TOKENS:
        raise ValueError(f"tokens must be one of {TOKENS}, got {tokens!r}")
    acc: dict[str, Any] = {"token_rows": 0}

    def consume(rows: list[torch.Tensor], mask: torch.Tensor | None) -> int:
        # Capture every token so that the rows of the estimation pass (all
        # tokens) are counted too; then pick the profile's tokens.
        if mask is None or include_padding:
            acc["token_rows"] += int(rows[0].shape[0] * rows[0].shape[1])
        else:
            acc["token_rows"] += int(mask.sum())
        # "last" is the last non-pad token even when padding is included.
        use_mask = None if (include_padding and tokens == "all") else mask
        chosen, chosen_mask = select_tokens(rows, use_mask, tokens)
        flat = [r.reshape(-1, r.shape[-1]) for r in chosen]
        keep = None if chosen_mask is None else chosen_mask.reshape(-1).nonzero().squeeze(1)
        if "d" not in acc:
            acc["d"] = _PairDistances(len(rows))
        acc["d"].add(flat, keep)
        return acc["d"].rows

    with _no_kv_cache(model):
        stack = stream_states(
            model,
            loader,
            consume,
            blocks=blocks,
            tokens="all",
            max_batches=max_batches,
            max_samples=max_samples,
            sample=sample,
            seed=seed,
            progress=progress,
            desc="replaceme: distances",
        )
    if "d" not in acc or acc["d"].rows == 0:
        raise ValueError("the loader yielded no rows (empty loader, or every token masked out)")
    return DistanceProfile(
        acc["d"].means(), tokens, acc["d"].rows, stack.path, token_rows=acc["token_rows"]
    )


# -- hooks on the MLP output ---------------------------------------------------


def _down_projection(block: nn.Module) -> Projection:
    """The projection that writes a block's MLP output into the residual stream."""
    try:
        return block_parts(block).down
    except ValueError:
        # Layouts block_parts does not fully know (no recognisable
        # attention, say) may still have a recognisable down projection.
        found = _projections(block).get("down")
        if found is None:
            raise ValueError(
                f"cannot find the MLP down-projection of {type(block).__name__} (looked for "
                "down_proj, fc2, mlp.c_proj, output.dense, mlp.Wo)"
            ) from None
        return found


def _is_cache(value: Any) -> bool:
    return any(cls.__name__ == "Cache" for cls in type(value).__mro__)


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module) -> Iterator[None]:
    """Calibration forwards build no KV cache (``config.use_cache = False``
    for the duration; restored after)."""
    config = getattr(model, "config", None)
    previous = getattr(config, "use_cache", None)
    if previous is None:
        yield
        return
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = previous


def _first_tensor(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class NotFoldableError(ValueError):
    """A block's MLP output does not enter the residual stream directly."""


class _MlpOutputs:
    """Forward hooks keeping the last batch's MLP output ``M`` of some blocks,
    and a one-off check that each block's output is ``Y + M`` (so that a
    transform of ``M`` can be folded into the down-projection)."""

    def __init__(self, stack: BlockStack, kept: Sequence[int], check: bool) -> None:
        self.outputs: dict[int, torch.Tensor] = {}
        self._probing = False
        self._checked: set[int] = set()
        self._handles = []
        for k in sorted(set(kept)):
            block = stack.blocks[k]
            down = _down_projection(block)
            self._handles.append(down.module.register_forward_hook(self._record(k)))
            if check:
                self._handles.append(
                    block.register_forward_hook(self._probe(k, down), with_kwargs=True)
                )

    def _record(self, k: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._probing:
                self.outputs[k] = _first_tensor(output)

        return hook

    def _probe(self, k: int, down: Projection):
        def hook(block: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._probing or k in self._checked:
                return
            self._checked.add(k)
            hidden = _first_tensor(output)
            scale = float(hidden.detach().float().abs().max()) or 1.0
            delta = torch.linspace(-scale, scale, hidden.shape[-1], device=hidden.device)
            # Run the block again without any KV cache (it would be extended twice).
            again_args = tuple(None if _is_cache(a) else a for a in args)
            again_kwargs = {n: None if _is_cache(v) else v for n, v in kwargs.items()}
            if "use_cache" in again_kwargs:
                again_kwargs["use_cache"] = False

            def shift(module: nn.Module, a: tuple, out: torch.Tensor) -> torch.Tensor:
                return out + delta.to(out.dtype)

            handle = down.module.register_forward_hook(shift)
            self._probing = True
            try:
                again = _first_tensor(block(*again_args, **again_kwargs))
            finally:
                handle.remove()
                self._probing = False
            moved = again.float() - hidden.float()
            tol = 1e-3 if hidden.dtype in (torch.float32, torch.float64) else 5e-2
            err = float((moved - delta).abs().max()) / scale
            if not err <= tol:
                raise NotFoldableError(
                    f"block {k} ({type(block).__name__}): adding a vector to the output of "
                    f"{down.path} does not add it to the block's output (relative mismatch "
                    f"{err:.3g}); a norm or another non-linear step follows the MLP (post-LN "
                    "blocks, a post-feedforward norm), so ReplaceMe's transform cannot be "
                    "folded there. Use placement='block' for a separate transform instead"
                )

        return hook

    def take(self, k: int) -> torch.Tensor:
        if k not in self.outputs:
            raise RuntimeError(f"the MLP of block {k} did not run in this forward pass")
        return self.outputs.pop(k)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# -- estimation ----------------------------------------------------------------


@dataclass
class _Cut:
    """One span being estimated, with its accumulators."""

    span: Span
    moments: Moments | TorchMoments | None = None
    sample: RowSample | None = None
    rows: int = 0

    @property
    def kept(self) -> int:
        return self.span.start - 1


def _flat(x: torch.Tensor, d: int, keep: torch.Tensor | None) -> torch.Tensor:
    x = x.reshape(-1, d)
    return x if keep is None else x[keep]


@dataclass(frozen=True)
class _Setup:
    """Options of one estimation pass."""

    objective: str
    placement: str
    loss: str
    need_moments: bool
    include_padding: bool
    capacity_bytes: int
    expected_rows: int | None
    buffer_dtype: Any
    buffer_dir: str | os.PathLike | None
    backend: str
    seed: int
    progress: bool

    @property
    def buffer_states(self) -> int:
        return 3 if (self.placement != "block" and self.loss == "exact") else 2


def _estimate(
    model: nn.Module,
    loader: Iterable,
    spans: list[Span],
    setup: _Setup,
    data: dict[str, Any],
    check: bool,
) -> list[_Cut]:
    """One pass over ``loader`` filling the accumulators of every cut."""
    stack = find_blocks(model, data["blocks"])
    cuts = [_Cut(s) for s in spans]
    wanted = sorted({k for s in spans for k in (s.start, s.stop)})
    pos = {state: i for i, state in enumerate(wanted)}
    folding = setup.placement != "block"
    recorder = _MlpOutputs(stack, [c.kept for c in cuts], check) if folding else None
    per_cut_bytes = setup.capacity_bytes // len(cuts)

    def open_accumulators(cut: _Cut, d: int, device: torch.device) -> None:
        if setup.need_moments:
            torch_side = setup.backend == "torch" or (
                setup.backend == "auto" and device.type != "cpu"
            )
            cut.moments = (
                TorchMoments(2, d, folds=0, pairs="all", device=device)
                if torch_side
                else Moments(2, d, folds=0, pairs="all")
            )
        if setup.objective == "cosine":
            itemsize = np.dtype(setup.buffer_dtype).itemsize
            row_bytes = setup.buffer_states * d * itemsize
            capacity = per_cut_bytes // row_bytes
            if setup.expected_rows:
                capacity = min(capacity, setup.expected_rows)
            if capacity < 1:
                raise ValueError(
                    f"max_buffer_bytes={setup.capacity_bytes} cannot hold one row of "
                    f"{row_bytes} bytes ({setup.buffer_states} states x {d} x {itemsize} B)"
                    + (f" for each of {len(cuts)} cuts" if len(cuts) > 1 else "")
                )
            cut.sample = RowSample(
                setup.buffer_states,
                d,
                int(capacity),
                dtype=setup.buffer_dtype,
                directory=setup.buffer_dir,
                seed=setup.seed,
                verbose=setup.progress,
            )

    def consume(rows: list[torch.Tensor], mask: torch.Tensor | None) -> int:
        d = int(rows[0].shape[-1])
        keep = None if (mask is None or setup.include_padding) else mask.reshape(-1)
        for cut in cuts:
            if cut.moments is None and cut.sample is None:
                open_accumulators(cut, d, rows[0].device)
            lk = _flat(rows[pos[cut.span.start]], d, keep)
            ls = _flat(rows[pos[cut.span.stop]], d, keep)
            if folding:
                m = _flat(recorder.take(cut.kept), d, keep)
                a, target = m, ls.double() - lk.double() + m.double()  # L_{k+n} − Y_k
            else:
                a, target = lk, ls
            if cut.moments is not None:
                if isinstance(cut.moments, TorchMoments):
                    cut.moments.update([a.double(), target.double()])
                else:
                    cut.moments.update([a.detach().cpu().double(), target.detach().cpu().double()])
            if cut.sample is not None:
                if setup.buffer_states == 3:  # exact loss: M, Y = L_k − M, L_{k+n}
                    cut.sample.add([m, lk.double() - m.double(), ls])
                else:
                    cut.sample.add([a, target])
            cut.rows += int(a.shape[0])
        return cuts[0].rows

    try:
        with _no_kv_cache(model):
            stream_states(
                model,
                loader,
                consume,
                states=wanted,
                tokens="all",
                desc="replaceme: estimating",
                **data,
            )
    except BaseException as exc:
        for cut in cuts:
            if cut.sample is not None:
                cut.sample.close()
        if isinstance(exc, ForwardError) and isinstance(exc.__cause__, NotFoldableError):
            raise exc.__cause__ from None
        raise
    finally:
        if recorder is not None:
            recorder.remove()
    if cuts[0].rows == 0:
        raise ValueError("the loader yielded no rows (empty loader, or every token masked out)")
    return cuts


def _as_moments(m: Moments | TorchMoments) -> Moments:
    return m.to_moments() if isinstance(m, TorchMoments) else m


# -- cosine objective ------------------------------------------------------------


@dataclass
class CosineFit:
    """Result of :func:`fit_cosine`: the transform and the objective (mean
    ``1 − cos`` plus the penalty) before training and after each epoch (or
    after L-BFGS)."""

    transform: np.ndarray = field(repr=False)
    history: list[float]

    @property
    def initial(self) -> float:
        return self.history[0]

    @property
    def final(self) -> float:
        return self.history[-1]


def fit_cosine(
    inputs: np.ndarray,
    targets: np.ndarray,
    offsets: np.ndarray | None = None,
    *,
    init: np.ndarray | None = None,
    structure: Literal["full", "diagonal"] = "full",
    solver: Literal["adam", "lbfgs"] = "adam",
    lr: float = 1e-4,
    batch_size: int = 1024,
    epochs: int = 10,
    lbfgs_steps: int = 100,
    penalty: Literal["l1", "l2"] | None = None,
    penalty_weight: float = 0.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> CosineFit:
    """Minimises ``mean_k [1 − cos(a_k T + c_k, b_k)] + α R(T)`` over T.

    ``inputs`` (rows ``a_k``), ``targets`` (``b_k``) and optional
    ``offsets`` (``c_k``) are ``(rows, d)`` arrays (memory-mapped files
    work: rows are read one batch at a time). ReplaceMe's approximate loss
    (Eq. 8/15, the default) is ``a = M``, ``b = L − Y``; the exact one
    (Eq. 7/14) is ``a = M``, ``c = Y``, ``b = L``. T starts at ``init``
    (default the identity, Table 13) and is trained in float32 on
    ``device``: ``solver="adam"`` (Table 13: lr 1e-4, shuffled batches of
    1024 rows, 10 epochs, seeded) or ``"lbfgs"`` (full-batch, strong Wolfe
    line search, at most ``lbfgs_steps`` iterations; the gradient is summed
    over batches). ``penalty`` adds ``α Σ|T|`` (``"l1"``) or ``α Σ T²``
    (``"l2"``) with ``α = penalty_weight``, on T itself (the paper does not
    say sum or mean, T or T − I). ``structure="diagonal"`` trains only the
    diagonal of T.
    """
    if structure not in ("full", "diagonal"):
        raise ValueError(
            f"the cosine objective supports structure 'full' or 'diagonal', got {structure!r}"
        )
    if solver not in ("adam", "lbfgs"):
        raise ValueError(f"solver must be 'adam' or 'lbfgs', got {solver!r}")
    if penalty not in (None, "l1", "l2"):
        raise ValueError(f"penalty must be None, 'l1' or 'l2', got {penalty!r}")
    if not (math.isfinite(penalty_weight) and penalty_weight >= 0):
        raise ValueError(f"penalty_weight must be a finite number >= 0, got {penalty_weight}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr}")
    batch_size = _check_int("batch_size", batch_size, 1)
    epochs = _check_int("epochs", epochs, 0)
    lbfgs_steps = _check_int("lbfgs_steps", lbfgs_steps, 1)
    n, d = inputs.shape
    if targets.shape != (n, d) or (offsets is not None and offsets.shape != (n, d)):
        raise ValueError("inputs, targets and offsets must all have shape (rows, d)")
    if n == 0:
        raise ValueError("no rows to fit the cosine objective on")
    device = torch.device(device)
    start = np.eye(d) if init is None else np.asarray(init, dtype=np.float64)
    if start.shape != (d, d):
        raise ValueError(f"init must have shape ({d}, {d}), got {start.shape}")
    if structure == "diagonal":
        param = torch.tensor(np.diagonal(start).copy(), dtype=torch.float32, device=device)
    else:
        param = torch.tensor(start, dtype=torch.float32, device=device)
    param.requires_grad_(True)

    def matrix() -> torch.Tensor:
        return torch.diag(param) if structure == "diagonal" else param

    def fetch(arr: np.ndarray, idx: np.ndarray | slice) -> torch.Tensor:
        return torch.from_numpy(np.asarray(arr[idx], dtype=np.float32)).to(device)

    def loss_sum(idx: np.ndarray | slice) -> torch.Tensor:
        pred = fetch(inputs, idx) @ matrix()
        if offsets is not None:
            pred = pred + fetch(offsets, idx)
        cos = torch.nn.functional.cosine_similarity(pred, fetch(targets, idx), dim=1, eps=1e-8)
        return (1.0 - cos).sum()

    def reg() -> torch.Tensor:
        if penalty is None or penalty_weight == 0:
            return param.new_zeros(())
        t = matrix()
        return penalty_weight * (t.abs().sum() if penalty == "l1" else t.pow(2).sum())

    def objective() -> float:
        total = 0.0
        with torch.no_grad():
            for lo in range(0, n, batch_size):
                total += float(loss_sum(slice(lo, lo + batch_size)))
            return total / n + float(reg())

    history = [objective()]
    from tqdm.auto import tqdm

    if solver == "adam":
        opt = torch.optim.Adam([param], lr=lr)
        rng = np.random.default_rng(seed)
        bar = tqdm(
            range(epochs), desc="replaceme: cosine (Adam)", disable=not progress, leave=False
        )
        for _ in bar:
            order = rng.permutation(n)
            for lo in range(0, n, batch_size):
                idx = np.sort(order[lo : lo + batch_size])
                opt.zero_grad(set_to_none=True)
                loss = loss_sum(idx) / len(idx) + reg()
                loss.backward()
                opt.step()
            history.append(objective())
            bar.set_postfix(objective=f"{history[-1]:.5g}")
    else:
        opt = torch.optim.LBFGS(
            [param],
            lr=1.0,
            max_iter=lbfgs_steps,
            history_size=20,
            tolerance_grad=1e-10,
            tolerance_change=1e-14,
            line_search_fn="strong_wolfe",
        )

        def closure() -> torch.Tensor:
            opt.zero_grad(set_to_none=False)
            total = param.new_zeros(())
            for lo in range(0, n, batch_size):
                part = loss_sum(slice(lo, lo + batch_size)) / n
                part.backward()
                total = total + part.detach()
            r = reg()
            if r.requires_grad:
                r.backward()
            return total + r.detach()

        opt.step(closure)
        history.append(objective())
    weight = matrix().detach().to("cpu", torch.float64).numpy()
    return CosineFit(weight, history)


# -- folding and removal ------------------------------------------------------------


def fold_transform(projection: Projection, transform: np.ndarray | torch.Tensor) -> None:
    """Folds ``y ↦ y T`` into a projection, in place: ``W ← Tᵀ W`` for
    torch's ``(out, in)`` layout, ``W ← W T`` for GPT-2's ``Conv1D``
    ``(in, out)`` layout, and ``b ← b T`` when it has a bias. Computed in
    float64 on the CPU and cast back to the weight's dtype and device."""
    module = projection.module
    t = torch.as_tensor(np.asarray(transform, dtype=np.float64))
    d = projection.out_features
    if t.shape != (d, d):
        raise ValueError(
            f"the transform has shape {tuple(t.shape)} but {projection.path} writes {d} features"
        )
    with torch.no_grad():
        w = module.weight
        w64 = w.detach().to("cpu", torch.float64)
        new = t.T @ w64 if projection.layout == "linear" else w64 @ t
        w.copy_(new.to(w.dtype))
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor):
            bias.copy_((bias.detach().to("cpu", torch.float64) @ t).to(bias.dtype))


class TransformedProjection(nn.Module):
    """A projection followed by an explicit ``d × d`` transform,
    ``y = inner(x) @ T`` (ReplaceMe's transform before folding; ``d²`` extra
    parameters). ``transform`` is an ``nn.Linear`` without bias holding ``Tᵀ``."""

    def __init__(self, inner: nn.Module, transform: np.ndarray) -> None:
        super().__init__()
        t = torch.as_tensor(np.asarray(transform, dtype=np.float64))
        reference = inner.weight
        self.inner = inner
        self.transform = nn.Linear(t.shape[0], t.shape[1], bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.transform.weight.copy_(t.T)
        self.transform.to(dtype=reference.dtype, device=reference.device)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.transform(self.inner(*args, **kwargs))


def _wrap_projection(block: nn.Module, projection: Projection, transform: np.ndarray) -> None:
    parent_path, _, name = projection.path.rpartition(".")
    parent = block.get_submodule(parent_path) if parent_path else block
    setattr(parent, name, TransformedProjection(projection.module, transform))


def _linear_translator(transform: np.ndarray, kind: str) -> Translator:
    d = transform.shape[0]
    return Translator(kind, transform, np.zeros(d), float("nan"), d, "replaceme")


# -- report -----------------------------------------------------------------------


def compression_ratio(params_before: int, params_after: int) -> float:
    """The paper's Eq. 10: ``(1 − N_pruned / N_original) × 100`` (percent)."""
    if params_before <= 0:
        raise ValueError(f"params_before must be > 0, got {params_before}")
    return 100.0 * (1.0 - params_after / params_before)


@dataclass
class ReplaceMeReport:
    """What :func:`replaceme` did.

    ``spans`` are the cuts (``Span.error`` holds the selection distance, NaN
    when the spans were given); ``transforms`` the fitted T (float64, the
    row-vector convention ``M T``; None for ``objective="identity"``);
    ``conditions`` the LS Gram conditioning (NaN otherwise); ``objectives``
    the cosine objective before and after training per cut (None for LS).
    """

    objective: str
    structure: str
    placement: str
    metric: str
    spans: list[Span]
    transforms: list[np.ndarray | None] = field(repr=False)
    conditions: list[float]
    objectives: list[tuple[float, float] | None]
    blocks_before: int
    blocks_after: int
    params_before: int
    params_after: int
    rows: int
    profile: DistanceProfile | None = field(default=None, repr=False)
    buffer_bytes: int = 0
    rows_kept: int = 0
    method: str = "replaceme"
    fit: str = "independent"

    @property
    def blocks_removed(self) -> int:
        return self.blocks_before - self.blocks_after

    @property
    def compression_by_blocks(self) -> float:
        """Fraction of blocks removed (the paper's "25%")."""
        return self.blocks_removed / self.blocks_before

    @property
    def compression_by_params(self) -> float:
        """Fraction of parameters removed (Eq. 10 divided by 100)."""
        return 1.0 - self.params_after / self.params_before

    @property
    def eq10_ratio(self) -> float:
        """The paper's Eq. 10 compression ratio, in percent."""
        return compression_ratio(self.params_before, self.params_after)

    def to_markdown(self) -> str:
        what = {
            "ls": "least-squares",
            "cosine": "cosine",
            "identity": "identity (UIDL: plain removal)",
        }[self.objective]
        where = {
            "fold": "folded into the down-projection",
            "mlp": "kept as a separate d×d module after the down-projection",
            "block": "as a separate d×d block on the residual stream (A.9)",
        }[self.placement]
        if self.objective == "identity":
            data = "no fit" if self.profile is None else f"cut chosen on {self.profile.rows:,} rows"
            what_fit = f"({data})"
        else:
            what_fit = f"({self.fit} fit, {self.rows:,} calibration rows)"
        lines = [
            f"**ReplaceMe** ({what}, {self.structure} T, {where}): {self.blocks_removed} of "
            f"{self.blocks_before} blocks removed in {len(self.spans)} cut(s) {what_fit}.",
            "",
            "| cut (toast) | paper i*→i*+n | reference (start, end) | "
            f"{self.metric} distance | LS condition | cosine objective |",
            "|---|---|---|---:|---:|---|",
        ]
        for k, span in enumerate(self.spans):
            cond = self.conditions[k]
            obj = self.objectives[k]
            dist = "—" if span.error != span.error else f"{span.error:.4g}"
            lines.append(
                f"| blocks[{span.start}:{span.stop}] | {span.paper} | "
                f"({span.start}, {span.stop}) | {dist} | "
                f"{'—' if cond != cond else f'{cond:.3g}'} | "
                f"{'—' if obj is None else f'{obj[0]:.5g} → {obj[1]:.5g}'} |"
            )
        lines += [
            "",
            f"Parameters: {self.params_before:,} → {self.params_after:,}; compression "
            f"{self.eq10_ratio:.2f}% by parameters (Eq. 10), "
            f"{100 * self.compression_by_blocks:.2f}% by blocks "
            f"({self.blocks_before} → {self.blocks_after}).",
        ]
        if self.buffer_bytes:
            lines.append(
                f"Cosine rows: {self.rows_kept:,} kept of {self.rows:,} in a "
                f"{_human(self.buffer_bytes)} disk buffer."
            )
        return "\n".join(lines)


# -- the method ------------------------------------------------------------------------


def _check_spans_for(
    spans: Sequence[tuple[int, int]], total: int, placement: str
) -> list[tuple[int, int]]:
    checked = validate_spans(spans, total)
    if sum(b - a for a, b in checked) >= total:
        raise ValueError(f"spans {checked} would remove every one of the {total} blocks")
    if placement != "block":
        for a, b in checked:
            if a < 1:
                raise ValueError(
                    f"span ({a}, {b}) starts at block 0: the transform is folded into the block "
                    "before the cut, so a cut must start at block 1 or later"
                )
        for (a1, b1), (a2, b2) in zip(checked, checked[1:], strict=False):
            if b1 == a2:
                raise ValueError(
                    f"spans ({a1}, {b1}) and ({a2}, {b2}) are adjacent: the second one's "
                    f"transform would go into block {a2 - 1}, which the first removes; merge "
                    f"them into ({a1}, {b2}) or keep a block between them"
                )
    return checked


def replaceme(
    model: nn.Module,
    loader: Iterable,
    *,
    num_blocks: int | None = None,
    objective: Literal["ls", "cosine", "identity"] = "ls",
    num_cuts: int = 1,
    adjacent: Literal["merge", "forbid"] = "merge",
    spans: Sequence[tuple[int, int]] | None = None,
    distance: Literal["angular", "cosine", "l2"] = "angular",
    distance_tokens: Tokens = "last",
    min_start: int = 1,
    structure: Literal["full", "diagonal", "orthogonal"] = "full",
    ridge: float = 0.0,
    loss: Literal["approximate", "exact"] = "approximate",
    solver: Literal["adam", "lbfgs"] = "adam",
    lr: float = 1e-4,
    batch_size: int = 1024,
    epochs: int = 10,
    lbfgs_steps: int = 100,
    penalty: Literal["l1", "l2"] | None = None,
    penalty_weight: float = 0.0,
    init: Literal["identity", "ls"] = "identity",
    placement: Literal["fold", "mlp", "block"] = "fold",
    fit: Literal["independent", "sequential"] = "independent",
    include_padding: bool = False,
    max_buffer_bytes: int = 8 * 2**30,
    buffer_dtype: Any = np.float32,
    buffer_dir: str | os.PathLike | None = None,
    blocks: str | None = None,
    max_batches: int | None = None,
    max_samples: int | None = None,
    sample: Literal["first", "random"] = "first",
    seed: int = 0,
    backend: Literal["auto", "c", "torch"] = "auto",
    check: bool = True,
    progress: bool = True,
) -> tuple[nn.Module, ReplaceMeReport]:
    """Removes ``num_blocks`` blocks by ReplaceMe, in place.

    **Cut.** A first pass over ``loader`` profiles the ``distance``
    (``"angular"``, the reference code's; ``"cosine"``; ``"l2"``) between
    states on ``distance_tokens`` (``"last"`` non-pad token by default);
    ``num_cuts`` windows of ``num_blocks / num_cuts`` blocks are chosen by
    :meth:`DistanceProfile.select` (``adjacent``, ``min_start``). Or give
    ``spans=[(start, stop), ...]`` and skip the profile.

    **Transform.** A second pass over ``loader`` (every non-pad token, or
    every token with ``include_padding=True`` as the reference does)
    estimates, per cut ``blocks[s:e]``, a T with ``M T + Y ≈ L_e`` where
    ``M`` is the MLP output of block ``s − 1`` and ``Y`` its attention
    residual:

    - ``objective="ls"``: ``T = (MᵀM + ridge·I)⁻¹ Mᵀ(L − Y)`` from float64
      moments (Cholesky in the C core); ``structure="diagonal"`` (Eq. 13) or
      ``"orthogonal"`` (Procrustes, ``UVᵀ``) for the Table 6 variants.
    - ``objective="cosine"``: :func:`fit_cosine` on rows kept in a
      disk-backed buffer of at most ``max_buffer_bytes`` (reservoir-sampled
      beyond that, so RAM and disk stay bounded; its size is printed before
      it is allocated); ``loss="approximate"`` ``1 − cos(M T, L − Y)`` (the
      default, Eq. 8) or ``"exact"`` ``1 − cos(M T + Y, L)`` (Eq. 7);
      ``solver``, ``lr``, ``batch_size``, ``epochs``, ``lbfgs_steps``,
      ``penalty``/``penalty_weight``; ``init="ls"`` starts from the LS
      solution (one pass gives both).
    - ``objective="identity"``: T = I, plain removal (UIDL, the baseline).

    **Placement.** ``"fold"`` (default): ``W ← Tᵀ W`` and ``b ← b T`` in the
    down-projection of block ``s − 1`` (float64, cast to the model dtype),
    then the blocks are deleted, ``layer_idx`` renumbered and the config's
    ``num_hidden_layers``/``layer_types`` updated: ``model.save_pretrained``
    writes a standard checkpoint. ``"mlp"``: the same T as an explicit
    module after the down-projection (for checks; ``d²`` extra
    parameters). ``"block"``: the paper's A.9 separate transform on the
    residual stream (``L_{s} T ≈ L_e`` as a :class:`toast.TranslatorBlock`;
    save with :func:`toast.save_pretrained`).

    **Several cuts**: ``fit="independent"`` (default) estimates every cut in
    one pass on the original model (the reference's LS multi-LT);
    ``"sequential"`` applies cuts in order, each estimated on the model
    with the previous ones already applied (the reference's cosine
    multi-LT; one pass per cut).

    ``check`` verifies on the first batch that each fold target block's
    output moves exactly with its MLP output (raises
    :class:`NotFoldableError` for post-LN blocks or post-MLP norms).
    Returns the model and a :class:`ReplaceMeReport`.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if distance not in DISTANCES:
        raise ValueError(f"distance must be one of {DISTANCES}, got {distance!r}")
    if loss not in ("approximate", "exact"):
        raise ValueError(f"loss must be 'approximate' or 'exact', got {loss!r}")
    if init not in ("identity", "ls"):
        raise ValueError(f"init must be 'identity' or 'ls', got {init!r}")
    if fit not in ("independent", "sequential"):
        raise ValueError(f"fit must be 'independent' or 'sequential', got {fit!r}")
    if backend not in ("auto", "c", "torch"):
        raise ValueError(f"backend must be 'auto', 'c' or 'torch', got {backend!r}")
    if objective == "cosine" and structure == "orthogonal":
        raise ValueError("structure='orthogonal' is a least-squares variant; use objective='ls'")
    if not (math.isfinite(float(ridge)) and ridge >= 0):
        raise ValueError(f"ridge must be a finite number >= 0, got {ridge}")
    max_buffer_bytes = _check_int("max_buffer_bytes", max_buffer_bytes, 1)
    if spans is None and num_blocks is None:
        raise ValueError("give num_blocks=<blocks to remove> (or spans=[(start, stop), ...])")
    stack = find_blocks(model, blocks)
    total = stack.num_blocks
    data = {
        "blocks": blocks,
        "max_batches": max_batches,
        "max_samples": max_samples,
        "sample": sample,
        "seed": seed,
        "progress": progress,
    }
    profile = None
    if spans is None:
        num_blocks = _check_num_blocks(num_blocks, total)
        num_cuts = _check_int("num_cuts", num_cuts, 1)
        if num_blocks % num_cuts:
            raise ValueError(
                f"num_blocks={num_blocks} is not a multiple of num_cuts={num_cuts}: every cut "
                "removes num_blocks / num_cuts blocks"
            )
        _check_min_start(min_start, total, num_blocks // num_cuts)
        profile = profile_distances(
            model, loader, tokens=distance_tokens, include_padding=include_padding, **data
        )
        chosen = profile.select(
            num_blocks, num_cuts, metric=distance, min_start=min_start, adjacent=adjacent
        )
    else:
        checked = _check_spans_for(spans, total, placement)
        if num_blocks is not None and num_blocks != sum(b - a for a, b in checked):
            raise ValueError(
                f"num_blocks={num_blocks} but the spans remove {sum(b - a for a, b in checked)}"
            )
        chosen = [Span(a, b, float("nan")) for a, b in checked]
    _check_spans_for([(s.start, s.stop) for s in chosen], total, placement)

    setup = _Setup(
        objective=objective,
        placement=placement,
        loss=loss,
        need_moments=objective == "ls" or (objective == "cosine" and init == "ls"),
        include_padding=include_padding,
        capacity_bytes=max_buffer_bytes,
        expected_rows=profile.token_rows if profile is not None else None,
        buffer_dtype=np.dtype(buffer_dtype),
        buffer_dir=buffer_dir,
        backend=backend,
        seed=seed,
        progress=progress,
    )
    cosine = {
        "structure": structure,
        "solver": solver,
        "lr": lr,
        "batch_size": batch_size,
        "epochs": epochs,
        "lbfgs_steps": lbfgs_steps,
        "penalty": penalty,
        "penalty_weight": penalty_weight,
        "seed": seed,
        "progress": progress,
    }
    params_before = count_params(model)
    results: list[tuple[np.ndarray | None, float, tuple[float, float] | None]] = []
    stats = {"rows": 0, "buffer": 0, "kept": 0}

    def solve(cut: _Cut) -> tuple[np.ndarray, float, tuple[float, float] | None]:
        ls, cond = None, float("nan")
        if cut.moments is not None:
            t = fit_translator(
                _as_moments(cut.moments),
                0,
                1,
                kind=_STRUCTURE_KIND[structure],
                ridge=float(ridge),
            )
            ls, cond = t.weight, t.condition
        if objective == "ls":
            return ls, cond, None
        sample_ = cut.sample
        try:
            stats["buffer"] += (
                sample_.capacity * sample_.num_states * sample_.dim * (sample_.dtype.itemsize)
            )
            stats["kept"] += sample_.rows
            if sample_.num_states == 3:
                args = (sample_.state(0), sample_.state(2), sample_.state(1))
            else:
                args = (sample_.state(0), sample_.state(1), None)
            device = next(model.parameters()).device
            result = fit_cosine(*args, init=ls, device=device, **cosine)
        finally:
            sample_.close()
        return result.transform, cond, (result.initial, result.final)

    def apply(where: list[Span], transforms: list[np.ndarray | None]) -> None:
        current = find_blocks(model, blocks)
        if objective == "identity":
            remove_blocks(model, [(s.start, s.stop) for s in where], blocks=blocks)
            return
        if placement == "block":
            kind = "diagonal" if structure == "diagonal" else "linear"
            translators = [_linear_translator(t, kind) for t in transforms]
            replace_spans(model, [(s.start, s.stop) for s in where], translators, blocks=blocks)
            return
        for span, t in zip(where, transforms, strict=True):
            block = current.blocks[span.start - 1]
            projection = _down_projection(block)
            if placement == "fold":
                fold_transform(projection, t)
            else:
                _wrap_projection(block, projection, t)
        remove_blocks(model, [(s.start, s.stop) for s in where], blocks=blocks)

    if objective == "identity":
        results = [(None, float("nan"), None) for _ in chosen]
        apply(chosen, [None] * len(chosen))
    elif fit == "independent" or len(chosen) == 1:
        cuts = _estimate(model, loader, chosen, setup, data, check)
        stats["rows"] = cuts[0].rows
        try:
            results = [solve(c) for c in cuts]
        finally:
            for c in cuts:
                if c.sample is not None:
                    c.sample.close()
        apply(chosen, [r[0] for r in results])
    else:
        removed = 0
        for span in chosen:
            shift = removed if placement != "block" else removed - len(results)
            where = Span(span.start - shift, span.stop - shift, span.error)
            (cut,) = _estimate(model, loader, [where], setup, data, check)
            stats["rows"] = max(stats["rows"], cut.rows)
            results.append(solve(cut))
            apply([where], [results[-1][0]])
            removed += span.num_blocks
    after = find_blocks(model, blocks).num_blocks
    report = ReplaceMeReport(
        objective=objective,
        structure=structure,
        placement=placement,
        metric=distance,
        spans=chosen,
        transforms=[r[0] for r in results],
        conditions=[r[1] for r in results],
        objectives=[r[2] for r in results],
        blocks_before=total,
        blocks_after=after,
        params_before=params_before,
        params_after=count_params(model),
        rows=stats["rows"],
        profile=profile,
        buffer_bytes=stats["buffer"],
        rows_kept=stats["kept"],
        fit=fit,
    )
    return model, report


# -- parameter counts from configs ---------------------------------------------------


def params_from_config(config: Any, remove: int = 0) -> int:
    """Parameters of the model ``config`` describes, after removing ``remove``
    blocks, counted on the meta device (no weights are allocated).

    The model is built with ``AutoModelForCausalLM`` (``AutoModel`` for
    configs without a causal-LM head) and the blocks are removed with the
    same :func:`toast.hf.surgery.remove_blocks` that :func:`replaceme` uses (the
    last ones; blocks are identical, so which ones does not matter).
    """
    import transformers

    remove = _check_int("remove", remove, 0)
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            model = transformers.AutoModel.from_config(config)
    if remove:
        total = find_blocks(model).num_blocks
        if remove >= total:
            raise ValueError(f"remove={remove} must be below the model's {total} blocks")
        remove_blocks(model, [(total - remove, total)])
    return count_params(model)
