"""One process's row numbers in a pass sharded over ``torch.distributed``
ranks: how many rows the batches a rank skips would give
(:class:`SkippedBatch`, counted from their inputs, never run), the number
one process would give the first row of each batch a rank consumes
(:class:`RowNumbers`), and the fold each row goes to (:func:`fold_ids`),
so that a sharded K-fold split is one process's."""

from __future__ import annotations

import torch

from toast.core import Moments

__all__ = ["RowNumbers", "SkippedBatch", "batch_size", "fold_ids", "input_shape"]


def _first_batched(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A batch's first tensor input with a batch dimension (None: none)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value
    return None


def batch_size(args: tuple, kwargs: dict) -> int:
    """The samples of a batch of forward inputs."""
    first = _first_batched(args, kwargs)
    if first is None:
        raise ValueError("cannot tell the batch size: the batch holds no tensor")
    return int(first.shape[0])


class SkippedBatch:
    """What a rank keeps of another rank's batch to number the rows after
    it: its size, its attention mask and the shape of its first input."""

    def __init__(self, size: int, mask: torch.Tensor | None, shape: tuple, ids: int | None):
        self.size, self.mask, self.shape, self.ids = size, mask, shape, ids

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> SkippedBatch:
        mask = kwargs.get("attention_mask")
        mask = mask.detach().bool().cpu() if isinstance(mask, torch.Tensor) else None
        ids = kwargs.get("input_ids")
        length = int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        return cls(batch_size(args, kwargs), mask, input_shape(args, kwargs), length)

    def rows(self, tokens: str, own_shape: tuple, own_tokens: int) -> int:
        """The rows this batch gives a pass taking ``tokens`` (as
        :func:`toast.hf.capture.states.select_tokens` selects them)."""
        if self.mask is not None:
            return int(self.mask.sum() if tokens == "all" else self.mask.any(dim=1).sum())
        if tokens != "all":
            return self.size
        if self.ids is not None:  # a token model: one state per input token
            return self.size * self.ids
        if self.shape == own_shape:  # inputs of one shape give states of one length
            return self.size * own_tokens
        raise ValueError(
            "under torch.distributed, folds are dealt by the row numbers of one process, "
            "which needs each batch's token count without running it: give batches of one "
            "shape, or an attention_mask, or use estimator='gcv' (no folds)"
        )


def input_shape(args: tuple, kwargs: dict) -> tuple:
    """The shape of a batch's first batched input past its batch dimension."""
    first = _first_batched(args, kwargs)
    return () if first is None else tuple(first.shape[1:])


class RowNumbers:
    """The number one process would give the first row of the batch a
    sharded pass consumes (:attr:`first_row`): the rows of every batch
    before it, this rank's and the others' (counted from their inputs,
    never run). Moments deal rows to folds by these numbers, so a sharded
    K-fold split is one process's."""

    def __init__(self) -> None:
        self.first_row = 0

    def skip(
        self,
        skipped: list[SkippedBatch],
        tokens: str,
        args: tuple,
        kwargs: dict,
        first: torch.Tensor,
    ) -> None:
        """Counts the other ranks' batches before this one (``first``: its
        first state, whose length states of inputs of its shape share)."""
        own_shape, own_tokens = input_shape(args, kwargs), int(first.shape[1])
        self.first_row += sum(b.rows(tokens, own_shape, own_tokens) for b in skipped)

    def advance(self, first: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Counts this rank's batch, once consumed."""
        self.first_row += int(first.shape[:-1].numel() if mask is None else mask.sum())


def fold_ids(
    first: torch.Tensor, mask: torch.Tensor | None, first_row: int, moments: Moments
) -> torch.Tensor:
    """The fold of each row of a batch (leading shape) as one process deals
    them: accepted row ``first_row + r`` to fold ``(first_row + r) % folds``
    (rows the mask drops get any fold; they are not added)."""
    lead = first.shape[:-1]
    if mask is None:
        order = torch.arange(lead.numel())
    else:
        order = mask.reshape(-1).to(torch.int64).cumsum(0) - 1
    return ((first_row + order) % moments.folds).reshape(lead)
