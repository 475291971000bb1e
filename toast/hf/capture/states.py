"""Streaming block outputs of a Hugging Face model into :class:`toast.Moments`.

Hooks record, for one batch at a time, the input of the first block (state
0, the embedding output) and the output of every block (state ``i`` = output
of block ``i - 1``, after its residual adds and before the model's final
norm). The chosen tokens of each batch are added to the moments and the
batch is dropped, so activations are never all held.
"""

from __future__ import annotations

import inspect
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, cast

import torch
from torch import nn

from toast._validation import Options, check
from toast.core import Moments, NonFiniteError, Pairs
from toast.core.chunked import ChunkedMoments, resolve_bound
from toast.core.errors import non_finite_error
from toast.hf.capture.beside import Beside, spare_cores
from toast.hf.capture.compute import forwards_in
from toast.hf.capture.distributed import check_same_batch, ranks_of, reduce_captured
from toast.hf.capture.row_numbers import RowNumbers, SkippedBatch, batch_size, fold_ids
from toast.hf.capture.torch_moments import TorchMoments
from toast.hf.data.calibration import BACKENDS, TOKENS, Calibration, Tokens, limited, warn_if_small
from toast.hf.data.progress import expected_samples, progress_bar
from toast.hf.model.blocks import BlockStack, find_blocks

__all__ = [
    "BACKENDS",
    "TOKENS",
    "ForwardError",
    "MomentsSink",
    "Tokens",
    "capture_moments",
    "check_materialized",
    "select_tokens",
    "stream_states",
    "uses_torch",
    "without_kv_cache",
]

# Keys of a batch that describe targets, not model inputs.
_TARGET_KEYS = frozenset({"labels", "label", "targets"})
# Keys of a tokenizer's output (per token, one row of ids per sample).
_TOKEN_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "position_ids"})


class _PassDone(Exception):
    """Raised by the hook of the last wanted state once it is recorded, and
    caught around the forward: the blocks after it, the final norm and the
    head (a vocabulary-wide matmul per token, on SmolLM2 about eight
    blocks' cost) would compute nothing any consumer reads."""


class _StateRecorder:
    """Forward hooks that keep the last batch's states (all of 0..L, or the
    chosen ones) and end the forward at the last of them."""

    def __init__(self, stack: BlockStack, states: list[int]) -> None:
        self.wanted = list(states)
        self.last = max(self.wanted)
        self.states: dict[int, torch.Tensor] = {}
        self._handles = []
        if 0 in self.wanted:
            self._handles.append(
                stack.blocks[0].register_forward_pre_hook(self._record_input, with_kwargs=True)
            )
        for state in sorted(set(self.wanted) - {0}):
            block = stack.blocks[state - 1]
            self._handles.append(block.register_forward_hook(self._output_hook(state)))

    def _record_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(
                f"cannot find the hidden states entering {type(module).__name__}: expected "
                "the first positional argument or hidden_states=..."
            )
        self.states[0] = hidden
        if self.last == 0:
            raise _PassDone

    def _output_hook(self, state: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if not isinstance(hidden, torch.Tensor):
                raise TypeError(
                    f"block {state - 1} ({type(module).__name__}) returned "
                    f"{type(output).__name__}; expected a tensor or a tuple starting with one"
                )
            self.states[state] = hidden
            if state == self.last:
                raise _PassDone

        return hook

    def take(self) -> list[torch.Tensor]:
        missing = [k for k in self.wanted if k not in self.states]
        if missing:
            raise RuntimeError(
                f"the forward pass did not run through every block (no state {missing}); "
                "does the model skip blocks or exit early?"
            )
        states = [self.states[k] for k in self.wanted]
        self.states = {}
        return states

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def uses_torch(backend: str, device: torch.device) -> bool:
    """Whether sums are formed with torch on ``device`` (``backend="auto"``:
    on accelerators) rather than copied to the C core."""
    return backend == "torch" or (backend == "auto" and device.type != "cpu")


def _model_device(model: nn.Module) -> torch.device:
    # the first loaded parameter: a part left on the meta device (an input
    # embedding a replay never reads) says nothing of where the model runs
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    return torch.device("cpu")


def without_kv_cache(model: nn.Module, kwargs: dict) -> dict:
    """``kwargs`` with ``use_cache=False`` when ``model``'s forward takes it:
    a pass that scores or records whole sequences never reuses a KV cache,
    and one built anyway grows with every block run on the batch (kept with
    recorded block inputs, it is appended to by every later block).
    ``inspect.signature`` follows the decorators that transformers wraps
    around ``forward``; the wrapper's own code object names no parameter."""
    accepted = inspect.signature(model.forward).parameters
    return {**kwargs, "use_cache": False} if "use_cache" in accepted else kwargs


def forward_inputs(
    model: nn.Module, batch: Any, device: torch.device | None = None
) -> tuple[tuple, dict]:
    """Positional and keyword inputs of one batch, on the model's device
    (or ``device``: a model on the meta device runs its parts elsewhere)."""
    device = _model_device(model) if device is None else device
    if isinstance(batch, (tuple, list)) and batch:
        if len(batch) > 2 and all(isinstance(b, Mapping) for b in batch):
            raise ValueError(
                f"a batch is a list of {len(batch)} dicts, one per sample: give the "
                "DataLoader a collate_fn that pads and stacks them, e.g. "
                "collate_fn=transformers.DataCollatorWithPadding(tokenizer)"
            )
        batch = batch[0]  # (inputs, labels) pairs
    if isinstance(batch, torch.Tensor):
        return (batch.to(device),), {}
    if isinstance(batch, Mapping):
        _check_collated(batch)
        accepted = inspect.signature(model.forward).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        kwargs = {
            k: (v.to(device) if isinstance(v, torch.Tensor) else v)
            for k, v in batch.items()
            if k not in _TARGET_KEYS and (takes_any or k in accepted)
        }
        return (), kwargs
    raise TypeError(
        "each batch must be a tensor, a dict of model inputs (e.g. a tokenizer's output), "
        f"or an (inputs, labels) pair; got {type(batch).__name__}"
    )


def _check_collated(batch: Mapping) -> None:
    """Refuses the two batches a DataLoader makes of per-sample tokenizer outputs."""
    for key, value in batch.items():
        if key in _TARGET_KEYS:
            continue
        if isinstance(value, torch.Tensor) and value.dim() == 3 and value.shape[1] == 1:
            if key in _TOKEN_KEYS:
                raise ValueError(
                    f"{key} has shape {tuple(value.shape)}: each sample was tokenized with "
                    "return_tensors='pt' (shape (1, tokens)) and the DataLoader stacked them; "
                    "tokenize without return_tensors and pad in a collate_fn "
                    "(transformers.DataCollatorWithPadding(tokenizer)), or squeeze(0) each sample"
                )
        if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
            raise ValueError(
                f"{key} is a list of {len(value)} tensors, not one tensor: the DataLoader's "
                "default collate transposed per-sample lists of token ids; pass "
                "collate_fn=transformers.DataCollatorWithPadding(tokenizer), or tokenize "
                "whole batches with padding=True, return_tensors='pt'"
            )


def check_materialized(model: nn.Module) -> None:
    """Refuses a model whose weights are not in memory (the meta device, or
    offloaded without the accelerate hooks that would bring them in)."""
    meta = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if not meta:
        return
    if any(hasattr(m, "_hf_hook") for m in model.modules()):
        return  # accelerate's hooks load offloaded weights at each forward
    raise ValueError(
        f"{len(meta)} parameters of the model (e.g. {meta[0]}) are on the meta device: "
        "they hold no data, so the forward pass cannot run. Load the model with its weights "
        "(from_pretrained without device_map='meta' or init_empty_weights), or keep the "
        "accelerate hooks of an offloaded model (device_map='auto')"
    )


def _truncate(args: tuple, kwargs: dict, n: int) -> tuple[tuple, dict]:
    def cut(v: Any) -> Any:
        return v[:n] if isinstance(v, torch.Tensor) and v.dim() > 0 else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def select_tokens(
    states: list[torch.Tensor], mask: torch.Tensor | None, tokens: str
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Rows to accumulate for one batch and the mask of valid rows (None: all
    valid), on the activations' device. Padding never gives a row: with
    ``tokens="all"`` the mask drops pad tokens, otherwise samples that are
    all padding."""
    first = states[0]
    if first.dim() != 3:
        raise ValueError(
            f"block outputs have shape {tuple(first.shape)}; expected (batch, tokens, dim)"
        )
    if mask is not None:
        mask = mask.to(first.device).bool()
        if mask.shape != first.shape[:2]:
            raise ValueError(
                f"attention_mask has shape {tuple(mask.shape)} but the hidden states have "
                f"(batch, tokens) = {tuple(first.shape[:2])}"
            )
    if tokens == "all":
        return [s.detach() for s in states], mask
    # One row per sample: a sample with no valid token (all padding) has no
    # row to give, and is dropped by the returned (batch,) mask.
    valid = None if mask is None or bool(mask.any(dim=1).all()) else mask.any(dim=1)
    if tokens == "cls":
        return [s[:, 0].detach() for s in states], valid
    if tokens == "mean":
        if mask is None:
            return [s.float().mean(dim=1) for s in states], None
        weights = mask.to(torch.float32).unsqueeze(-1)
        count = weights.sum(dim=1).clamp_min(1.0)
        return [(s.float() * weights).sum(dim=1) / count for s in states], valid
    # "last": the last valid token of each sequence, whatever side is padded.
    if mask is None:
        return [s[:, -1].detach() for s in states], None
    length = mask.shape[1]
    last = length - 1 - torch.flip(mask, dims=[1]).to(torch.int64).argmax(dim=1)
    rows = torch.arange(first.shape[0], device=first.device)
    return [s[rows, last].detach() for s in states], valid


class ForwardError(RuntimeError):
    """The model's forward pass failed on a batch of the loader."""


def _describe(args: tuple, kwargs: dict) -> str:
    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            return f"{dtype}{list(value.shape)}"
        return type(value).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _run_forward(model: nn.Module, args: tuple, kwargs: dict, index: int) -> None:
    try:
        model(*args, **kwargs)
    except _PassDone:
        pass
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as exc:
        raise ForwardError(
            f"the model's forward pass failed on batch {index} of the loader "
            f"({_describe(args, kwargs)}): {type(exc).__name__}: {exc}"
        ) from exc


def rss_mib() -> float:
    """The process's resident memory in MiB (NaN where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


def check_states(states: Sequence[int] | None, num_states: int) -> list[int]:
    """``states`` (None: all of them) as distinct state indices in range;
    raises naming the bad one."""
    if states is None:
        return list(range(num_states))
    chosen = [int(k) for k in states]
    if not chosen:
        raise ValueError("states must name at least one state")
    for k in chosen:
        if not 0 <= k < num_states:
            raise ValueError(
                f"state {k} is out of range: the model has states 0..{num_states - 1} "
                "(0 = embedding output, i = output of block i - 1)"
            )
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"states {chosen} name a state twice")
    return chosen


def _same_on_every_rank(
    inputs: Iterator[tuple[tuple, dict]], ranks: Any
) -> Iterator[tuple[tuple, dict]]:
    """``inputs``, the first checked to be every rank's under ``ranks``."""
    for index, (args, kwargs) in enumerate(inputs):
        if ranks is not None and index == 0:
            check_same_batch((args, kwargs), ranks)
        yield args, kwargs


def stream_states(
    model: nn.Module,
    loader: Iterable,
    consume: Callable[[list[torch.Tensor], torch.Tensor | None], int],
    calibration: Calibration | None = None,
    *,
    stack: BlockStack | None = None,
    states: Sequence[int] | None = None,
    tokens: Tokens = "all",
    desc: str = "capturing",
    shard: bool = False,
    numbers: RowNumbers | None = None,
    **options: Any,
) -> BlockStack:
    """Runs ``model`` over ``loader`` and hands each batch's states to ``consume``.

    ``consume(rows, mask)`` receives the chosen tokens of the chosen states
    (tensors on the model's device, ``(batch, tokens, dim)`` with a row mask
    for ``tokens="all"``, else ``(batch, dim)``) and returns the running row
    count shown in the progress bar. ``calibration`` (or its fields as
    keywords, see :class:`toast.Calibration`) bounds and orders the pass;
    ``stack`` is the model's block stack when the caller has found it
    already. ``shard``: under ``torch.distributed`` (``Calibration.shard``)
    this rank forwards only its batches, ``k % world == rank``
    (:mod:`toast.hf.capture.distributed`): the caller then sums what
    ``consume`` gathered over the ranks; passes that cannot be summed
    (row samples) leave it False and every rank forwards every batch.
    ``numbers`` (a :class:`RowNumbers`) is told, before each ``consume``,
    the number a single process would give the batch's first row.
    Each forward ends at the last chosen state: the rest reads nothing.
    Hooks are removed and the model's mode restored on every exit,
    including ``KeyboardInterrupt``; the model's weights are never touched.
    Returns the block stack.
    """
    cal = Calibration.from_options(calibration, **options)
    check("tokens", tokens, Options(TOKENS))
    stack = stack if stack is not None else find_blocks(model, cal.blocks)
    check_materialized(model)
    recorder = _StateRecorder(stack, check_states(states, stack.num_blocks + 1))
    was_training = model.training
    ranks = ranks_of(cal) if shard else None
    skipped: list[SkippedBatch] = []  # other ranks' batches since this rank's last one
    bar = None
    try:
        bar = progress_bar(desc, None, "sample", disable=not cal.progress)
        model.eval()
        with torch.inference_mode():
            inputs = _same_on_every_rank(calibration_inputs(model, loader, cal), ranks)
            first = True
            for index, (args, kwargs) in enumerate(inputs):
                if ranks is not None and not ranks.owns(index):
                    if numbers is not None:
                        skipped.append(SkippedBatch.of(args, kwargs))
                    continue
                with forwards_in(model, cal.compute_dtype):
                    _run_forward(model, args, kwargs, index)
                rows, row_mask = select_tokens(
                    recorder.take(), kwargs.get("attention_mask"), tokens
                )
                if numbers is not None:
                    numbers.skip(skipped, tokens, args, kwargs, rows[0])
                    skipped.clear()
                total = consume(rows, row_mask)
                if numbers is not None:
                    numbers.advance(rows[0], row_mask)
                size = batch_size(args, kwargs)
                if first:
                    first = False
                    bar.total = expected_samples(loader, cal.max_samples, cal.max_batches, size)
                    if ranks is not None and bar.total is not None:
                        bar.total = -(-bar.total // ranks.world)  # about this rank's share
                # the postfix first: the redraw of update() shows this batch's rows
                bar.set_postfix(tokens=f"{total:,}", rss=f"{rss_mib():.0f}MiB", refresh=False)
                bar.update(size)
    finally:
        recorder.remove()
        model.train(was_training)
        if bar is not None:
            bar.close()
    return stack


def statistics_bound(statistics_bytes: int | str | None, cal: Calibration) -> int | str | None:
    """The sink's bound: none under ``torch.distributed`` (the ranks sum
    whole moments), else ``statistics_bytes``."""
    return None if cal.is_distributed else statistics_bytes


def calibration_inputs(
    model: nn.Module, loader: Iterable, cal: Calibration, device: torch.device | None = None
) -> Iterator[tuple[tuple, dict]]:
    """Each batch's forward inputs, within ``max_batches`` and ``max_samples``."""
    samples = 0
    for batch in itertools.islice(limited(loader, cal), cal.max_batches):
        args, kwargs = forward_inputs(model, batch, device)
        size = batch_size(args, kwargs)
        if cal.max_samples is not None:
            remaining = cal.max_samples - samples
            if remaining <= 0:
                return
            if size > remaining:
                args, kwargs = _truncate(args, kwargs, remaining)
                size = remaining
        samples += size
        yield args, kwargs


def capture_moments(
    model: nn.Module,
    loader: Iterable,
    *,
    states: Sequence[int] | None = None,
    tokens: Tokens = "all",
    folds: int = 5,
    pairs: Pairs = "all",
    precision: Literal["float64", "mixed"] = "float64",
    backend: Literal["auto", "c", "torch"] = "auto",
    calibration: Calibration | None = None,
    stack: BlockStack | None = None,
    observe: Callable[[list[torch.Tensor], torch.Tensor | None], None] | None = None,
    statistics_bytes: int | str | None = None,
    **options: Any,
) -> tuple[Moments | ChunkedMoments, BlockStack]:
    """Runs ``model`` over ``loader`` and returns the moments of its states.

    ``loader`` yields tensors (e.g. ``pixel_values``), dicts of model inputs
    (a tokenizer's output, whose ``attention_mask`` keeps padding out of the
    statistics) or ``(inputs, labels)`` pairs. ``states`` picks which states
    to keep (default all ``L + 1``; moment index ``k`` is then state
    ``states[k]``). ``tokens`` chooses the rows: every valid token, the
    first (CLS) token, the masked mean, or the last valid token.
    ``calibration`` (or its fields as keywords: ``max_batches``,
    ``max_samples``, ``sample``, ``seed``, ``blocks``, ``progress``,
    ``distributed``, ``group``; see :class:`toast.Calibration`) bounds and
    orders the pass. The model runs in eval mode under
    ``torch.inference_mode`` and is left as it was found.

    ``backend`` says where the sums are formed: ``"c"`` copies each batch
    to the host and accumulates in the C core; ``"torch"`` accumulates on
    the activations' device with torch (:class:`toast.hf.capture.torch_moments.TorchMoments`)
    and copies only the final sums; ``"auto"`` (default) takes ``"torch"``
    for activations on an accelerator and ``"c"`` on the CPU.

    Under ``torch.distributed`` (``distributed=None`` detects an initialised
    process group; ``group`` chooses one), every rank passes the same data
    and forwards its share of the batches (batch ``k`` on rank
    ``k % world``); the moments are summed over the ranks, the rows dealt to
    folds by one process's row numbers, so every rank returns one process's
    moments (to rounding). With ``shard=False`` each rank passes its own
    shard instead, used whole, its rows dealt to folds by its own counter
    (a valid K-fold split, not one process's). ``observe`` may define
    ``reduce_over(ranks)``, called after a sharded pass to combine what
    every rank observed (:class:`toast.hf.capture.distributed.Observers`
    joins several).

    ``observe(rows, mask)``, when given, sees every batch the moments see
    (e.g. :class:`toast.hf.capture.massive.MassiveRows`).

    ``statistics_bytes``: when the moments would hold more
    (``Moments.estimate_nbytes``), the rows wait on disk instead and a
    :class:`toast.core.chunked.ChunkedMoments` is returned (one process only).
    """
    cal = Calibration.from_options(calibration, **options)
    check("backend", backend, Options(BACKENDS))
    bound = statistics_bound(statistics_bytes, cal)
    sink = MomentsSink(states, folds, pairs, precision, backend, bound)
    ranks = ranks_of(cal)
    sink.sharded = ranks is not None
    # one process's row numbers deal the folds, so a sharded split is its split
    sink.numbers = RowNumbers() if ranks is not None and folds else None

    def consume(rows: list[torch.Tensor], mask: torch.Tensor | None) -> int:
        if observe is not None:
            observe(rows, mask)
        return sink(rows, mask)

    stack = sink.beside_the_forward(lambda: stream_states(
        model, loader, consume, cal, stack=stack, states=states, tokens=tokens,
        shard=True, numbers=sink.numbers,
    ), alone=ranks is None)  # fmt: skip
    reduce = getattr(observe, "reduce_over", None)
    if ranks is not None and callable(reduce):  # e.g. MassiveRows: every rank's rows
        reduce(ranks)
    num_states = stack.num_blocks + 1 if states is None else len(states)
    return sink.result(num_states, cal), stack


class MomentsSink:
    """The consumer of a capture pass: opens :class:`toast.Moments` (or
    :class:`TorchMoments` on an accelerator) on the first batch and adds
    every batch's rows; :meth:`result` gives the moments (summed over ranks
    under ``torch.distributed``)."""

    def __init__(
        self,
        states: Sequence[int] | None,
        folds: int,
        pairs: Pairs,
        precision: Literal["float64", "mixed"],
        backend: Literal["auto", "c", "torch"],
        bound: int | str | None = None,
    ) -> None:
        self.states, self.folds, self.pairs = states, folds, pairs
        self.precision, self.backend, self.bound = precision, backend, bound
        self.moments: Moments | TorchMoments | ChunkedMoments | None = None
        self.samples = 0  # samples seen here, for the calibration-size warning
        #: this rank forwarded its share of the batches (the sums then reduce)
        self.sharded = False
        #: one process's number of each batch's first row (sharded K-fold moments)
        self.numbers: RowNumbers | None = None
        #: where the C core's updates run (:mod:`toast.hf.capture.beside`; default in line)
        self.beside = Beside(enabled=False)
        self._rows_sent = 0  # rows handed to the moments (some maybe still being added)

    def beside_the_forward(self, run: Callable[[], BlockStack], alone: bool) -> BlockStack:
        """``run()``, the pass that feeds this sink, with each batch's sums
        added beside the next batch's forward where the cores allow
        (:func:`toast.hf.capture.beside.spare_cores`; bit for bit the same);
        ``alone`` False (ranks of a process group, which share the machine's
        cores and each count only their own threads): in line."""
        self.beside = Beside(alone and spare_cores())
        try:
            return run()
        except BaseException:
            self.beside.abandon()
            raise

    def _open(self, rows: list[torch.Tensor]) -> Moments | TorchMoments | ChunkedMoments:
        device = rows[0].device
        dim = int(rows[0].shape[-1])
        folds, pairs, precision = self.folds, self.pairs, self.precision
        bound = None if self.bound is None else resolve_bound(self.bound, dim, folds)
        if bound is not None and Moments.estimate_nbytes(len(rows), dim, folds, pairs) > bound:
            return ChunkedMoments(len(rows), dim, folds, pairs, precision, bound)
        if uses_torch(self.backend, device):
            return TorchMoments(
                len(rows), dim, folds=folds, pairs=pairs, precision=precision, device=device
            )
        return Moments(len(rows), dim, folds=folds, pairs=pairs, precision=precision)

    def __call__(self, rows: list[torch.Tensor], mask: torch.Tensor | None) -> int:
        if self.moments is None:
            self.moments = self._open(rows)
        m = self.moments
        self.samples += int(rows[0].shape[0])
        # rows[k] is state chosen[k] (the pass has checked the states)
        chosen = range(len(rows)) if self.states is None else list(self.states)
        first_row = None if self.numbers is None else self.numbers.first_row
        if isinstance(m, (TorchMoments, ChunkedMoments)):
            _update(m, rows, mask, chosen, first_row)
            return m.rows
        host = [r.cpu() for r in rows]
        host_mask = None if mask is None else mask.cpu()
        self.beside.run(_update, m, host, host_mask, chosen, first_row)
        lead = host[0].shape[:-1].numel()
        self._rows_sent += lead if host_mask is None else int(host_mask.sum())
        return self._rows_sent

    def collected(self) -> Moments | ChunkedMoments | None:
        """The sums so far as :class:`toast.Moments` (None before any batch;
        the rows on disk when the moments would exceed the sink's bound)."""
        self.beside.close()
        moments = self.moments
        return moments.to_moments() if isinstance(moments, TorchMoments) else moments

    def result(self, num_states: int, cal: Calibration) -> Moments | ChunkedMoments:
        return self.finish(self.collected(), num_states, cal)

    def finish(
        self, moments: Moments | ChunkedMoments | None, num_states: int, cal: Calibration
    ) -> Moments | ChunkedMoments:
        """The moments summed over ranks, checked for rows (and warned about
        when they are few for the width)."""
        local_rows = 0 if moments is None else moments.rows
        # summed when this rank forwarded its share, or was given its own
        # shard (shard=False); a pass every rank ran whole is whole already
        if cal.is_distributed and (self.sharded or not cal.shard):
            assert not isinstance(moments, ChunkedMoments)  # bound=None under distributed
            moments = reduce_captured(
                moments, num_states, self.folds, self.pairs, self.precision, cal.group
            )
        if moments is None or moments.rows == 0:
            raise ValueError("the loader yielded no rows (empty loader, or every token masked out)")
        warn_if_small(moments.rows, moments.dim, self.folds, self.samples, local_rows)
        return moments


def _update(
    moments: Moments | TorchMoments | ChunkedMoments,
    states: list[torch.Tensor],
    mask: torch.Tensor | None,
    chosen: Sequence[int],
    first_row: int | None = None,
) -> None:
    try:
        if isinstance(moments, TorchMoments):  # first_row None: its own counter
            # cast: mypy keeps a Moments subclass in the narrowed union
            cast(TorchMoments, moments).update(states, mask=mask, first_row=first_row)
        elif first_row is None or isinstance(moments, ChunkedMoments):
            moments.update(states, mask=mask)
        else:
            moments.update(states, mask=mask, fold=fold_ids(states[0], mask, first_row, moments))
    except NonFiniteError as exc:
        if exc.state is None:
            raise
        raise naming_state(exc.state, chosen) from exc


def naming_state(index: int, chosen: Sequence[int]) -> ValueError:
    """The error for NaN or Inf in entry ``index`` of the states passed to
    the moments, naming the model's state (the same type)."""
    state = chosen[index]
    where = "the embedding output" if state == 0 else f"the output of block {state - 1}"
    return non_finite_error(
        f"{where} (state {state}) contains NaN or Inf; in float16 this is usually "
        "an overflow: run the model in bfloat16 or float32",
        state,
    )
