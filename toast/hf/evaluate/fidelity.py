"""Fidelity to the original model, measured in the pass that measures
perplexity: how far a compressed causal LM's next-token distribution moved
from the original's, token by token.

The first model an :class:`toast.hf.evaluate.quality.Evaluator` measures is
the reference (measure the original first). For every predicted token it
keeps the reference's ``top_k`` log-probabilities (float32) and their token
ids (int32), the log of the mass outside them (the tail) and its argmax:
``8 * top_k + 8`` bytes a token, never the whole logits. Every model
measured, the reference included, is then scored by the same code:

- ``kl``: the mean over predicted tokens of KL(original || model), computed
  in float64 on both distributions coarse-grained to the reference's top-k
  tokens plus one bucket for the rest of the vocabulary. When ``top_k``
  covers the vocabulary this is the exact KL. Otherwise merging tokens can
  only lose information, so by the data-processing inequality it is a
  lower bound of the exact KL; what it leaves out is, token by token,
  exactly the tail's mass under the reference times the KL between the
  two distributions renormalized within the tail, so ``tail_mass`` (the
  reference's mean tail mass) says how much of the distribution goes
  unseen. 4096 tokens of SmolLM2's 49,152 gave 99.3% of the exact KL;
- ``kl_p99``: the 99th percentile of the per-token KL (linear
  interpolation, as ``torch.quantile``), where a model that stays fluent on
  average but breaks on some tokens shows;
- ``agreement``: the share of predicted tokens whose argmax equals the
  reference's (llama.cpp's "same top p");
- ``perplexity``: ``exp`` of the mean next-token NLL.

An unmodified model therefore scores KL 0 and agreement 1 exactly: its
coarse-grained distribution is bit for bit the one kept. Logits are read
in chunks of :data:`CHUNK` positions of one row, once in float32 (their
exponentials, summed, give the log-normalizer to about 1e-7), which bounds
the temporaries to ``CHUNK x vocabulary x 4`` bytes, twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

__all__ = [
    "CHUNK",
    "DEFAULT_TOP_K",
    "MISMATCH",
    "Recording",
    "TokenFidelity",
    "coarse_kl",
    "quantile",
]

#: The reference's tokens kept per predicted token (32 KiB a token): the
#: smallest power of two whose KL came within 1% of the exact one on
#: SmolLM2-135M (vocabulary 49,152) pruned by ReplaceMe and by plain removal
#: (benchmarks/results/fidelity-topk.md).
DEFAULT_TOP_K = 4096
#: Positions of one row whose logits are read at once.
CHUNK = 128

T = TypeVar("T")
#: Why a later pass cannot be compared with the reference's.
MISMATCH = (
    "the held-out data gave other predicted tokens than on the reference pass: it must "
    "give the same samples in the same order on every pass"
)


class Recording(Generic[T]):
    """Values of the reference pass in pass order: recorded while the first
    pass runs, replayed to every later pass, which must produce the same
    sequence of chunks (the same held-out data in the same order)."""

    def __init__(self) -> None:
        self._chunks: list[tuple[T, int]] = []
        self._done = False
        self._at = 0

    @property
    def recording(self) -> bool:
        return not self._done

    def begin(self) -> None:
        """A pass starts; a reference pass that failed part way is dropped."""
        self._at = 0
        if not self._done:
            self._chunks.clear()

    def add(self, value: T, rows: int) -> T:
        """Records the reference's next chunk, of ``rows`` predictions."""
        self._chunks.append((value, rows))
        return value

    def next(self, rows: int) -> T:
        """The reference's next chunk, replayed; ``rows``: the predictions
        this pass has for it (``ValueError`` unless the reference had as many)."""
        if self._at >= len(self._chunks) or self._chunks[self._at][1] != rows:
            raise ValueError(MISMATCH)
        self._at += 1
        return self._chunks[self._at - 1][0]

    def end(self) -> None:
        """A pass ended; a replayed pass must have used every chunk."""
        if self._done and self._at != len(self._chunks):
            raise ValueError(MISMATCH)
        self._done = True


@dataclass(frozen=True)
class _Kept:
    """The reference's distribution over one chunk of predicted tokens."""

    ids: torch.Tensor  # int32 [n, k]: its top-k tokens
    coarse: torch.Tensor  # float32 [n, k + 1]: their log-probabilities, then the tail's
    top1: torch.Tensor  # int32 [n]: its argmax


def coarse_kl(reference: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    """Per-row KL(reference || model) in float64 between distributions given
    as log-probabilities over the same buckets (``[n, buckets]``); a bucket
    the reference gives no mass adds nothing."""
    lp, lq = reference.double(), model.double()
    p = lp.exp()
    # where, not a product: 0 * (-inf - -inf) would be nan
    return torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum(dim=-1)


def quantile(values: torch.Tensor, q: float) -> float:
    """``torch.quantile(values, q)`` (linear interpolation) for any length:
    ``torch.quantile`` refuses inputs over 16M elements."""
    ordered = values.double().flatten().sort().values
    position = q * (ordered.numel() - 1)
    low = math.floor(position)
    high = min(low + 1, ordered.numel() - 1)
    weight = position - low
    return float(ordered[low] * (1 - weight) + ordered[high] * weight)


class TokenFidelity:
    """One pass's perplexity and fidelity to the reference over predicted
    tokens; :meth:`add` a row of logits at a time, then :meth:`result`."""

    def __init__(self, reference: Recording[_Kept] | None, top_k: int) -> None:
        # None: perplexity alone (no reference kept, nothing compared)
        self.reference, self.top_k = reference, top_k
        self.nll = 0.0
        self.count = 0
        self.agree = 0
        self.tail = 0.0
        self.kl: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """``logits`` ``[n, vocabulary]`` of ``n`` predicted tokens, ``targets``
        ``[n]`` their next tokens."""
        for start in range(0, logits.shape[0], CHUNK):
            stop = start + CHUNK
            self._chunk(logits[start:stop], targets[start:stop])

    def _chunk(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        x = logits.float()
        peak, top1 = x.max(dim=-1)
        # exp relative to each row's maximum: float32 terms, no overflow; the
        # float64 log of their sum is the log-normalizer to about 1e-7
        e = (x - peak[:, None]).exp_()
        lse = peak.double() + e.sum(dim=-1).double().log()
        self.nll += float((lse - x.gather(-1, targets[:, None])[:, 0].double()).sum())
        self.count += int(targets.shape[0])
        if self.reference is None:
            return
        top1 = top1.int().cpu()
        if self.reference.recording:
            ids = x.topk(min(self.top_k, x.shape[-1]), dim=-1).indices
            coarse = _coarse(x, e, peak, lse, ids).cpu()
            kept = self.reference.add(_Kept(ids.int().cpu(), coarse, top1), len(top1))
        else:
            kept = self.reference.next(len(top1))
            ids = kept.ids.to(x.device, torch.int64)
            coarse = _coarse(x, e, peak, lse, ids).cpu()
        # the reference pass too is scored against what it kept, by the same code
        self.kl.append(coarse_kl(kept.coarse, coarse))
        self.agree += int((top1 == kept.top1).sum())
        self.tail += float(kept.coarse[:, -1].double().exp().sum())

    def result(self) -> dict[str, float]:
        """The pass's metrics (keys of :data:`toast.hf.evaluate.quality.FIDELITY_METRICS`
        for causal LMs; perplexity alone without a reference)."""
        if self.reference is None:
            return {"perplexity": math.exp(self.nll / self.count)}
        kl = torch.cat(self.kl)
        return {
            "perplexity": math.exp(self.nll / self.count),
            "kl": float(kl.mean()),
            "kl_p99": quantile(kl, 0.99),
            "agreement": self.agree / self.count,
            "tail_mass": self.tail / self.count,
        }


def _coarse(
    x: torch.Tensor, e: torch.Tensor, peak: torch.Tensor, lse: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The distribution of logits ``x`` coarse-grained to the tokens ``ids``
    plus the rest: their log-probabilities, then the log of the rest's mass,
    rounded to float32 (as kept) so that the reference compared with itself
    is bit for bit equal. ``e``: ``exp(x - peak)`` (consumed), ``lse``: the
    log-normalizer (float64)."""
    kept = x.gather(-1, ids).double() - lse[:, None]
    # the rest's mass summed on its own, not 1 - sum(kept): no cancellation
    # (and none at all when ids cover the vocabulary: log 0 = -inf)
    rest = e.scatter_(-1, ids, 0.0).sum(dim=-1).double().log() + peak.double() - lse
    return torch.cat([kept, rest[:, None]], dim=-1).float()
