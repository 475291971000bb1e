"""Running a registered method: raw data in, measured quality out.

Every in-memory run (``toast.compress`` on a model, or on a checkpoint
folder that fits memory; ``toast.methods.replaceme.replaceme``) goes through :func:`run_method`,
which

1. turns raw text (a file, a list of strings, a ``datasets``-style dataset,
   chat ``"messages"``) into batches with the user's tokenizer
   (:mod:`toast.hf.data.text`); loaders pass through unchanged;
2. with ``heldout`` data, measures the original model first, then plain
   removal of the blocks the method chose (on the intact model, just before
   the method changes it: :func:`toast.hf.evaluate.quality.skipped_blocks`), then the
   compressed model, and puts the three figures in the report
   (``report.quality``, shown by ``report.to_markdown()``), each with its
   fidelity to the original measured in the same pass (KL, its 99th
   percentile and top-1 agreement for causal LMs; agreement of the
   predicted class for classifiers).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from toast.hf.data.text import TEXT_OPTIONS, TextData, as_batches

if TYPE_CHECKING:
    from torch import nn

    from toast.hf.model.blocks import BlockStack
    from toast.methods.base import Method, Report
    from toast.spans import Span

__all__ = [
    "TEXT_OPTIONS",
    "prepare_data",
    "run_method",
    "split_heldout",
    "split_text_options",
]


def split_text_options(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``params`` split into (raw-text options, everything else)."""
    text = {k: v for k, v in params.items() if k in TEXT_OPTIONS}
    rest = {k: v for k, v in params.items() if k not in TEXT_OPTIONS}
    return text, rest


def run_method(
    method: Method,
    model: nn.Module,
    data: Iterable | None,
    config: Any,
    *,
    heldout: Iterable | None = None,
    text: Mapping[str, Any] | None = None,
) -> tuple[nn.Module, Report]:
    """Runs ``method`` on ``model`` with ``config``; ``data`` and ``heldout``
    are batches, or raw text read with ``text`` (:data:`TEXT_OPTIONS`:
    ``tokenizer``, ``max_length``, ``batch_size``, ``num_samples``, ``pack``,
    ``field``). A float ``heldout`` holds out that fraction of raw ``data``'s
    samples (the last ones) and calibrates on the rest."""
    from toast.methods.driver import runner_of

    data, heldout = prepare_data(method, data, heldout, text)
    if heldout is None:
        return runner_of(method)(model, data, config, None)
    return _run_measured(method, model, data, config, heldout)


def prepare_data(
    method: Method,
    data: Any,
    heldout: Any = None,
    text: Mapping[str, Any] | None = None,
) -> tuple[Iterable | None, Iterable | None]:
    """``data`` and ``heldout`` as batches (raw text read with ``text``:
    :func:`heldout_batches`); ``ValueError`` when ``method`` needs data and
    has none."""
    text = dict(text or {})
    if data is not None:
        data = as_batches(data, **text)
    if method.needs_data and data is None:
        raise ValueError(f"method={method.name!r} needs calibration data (a loader of batches)")
    return heldout_batches(data, heldout, text)


def heldout_batches(
    data: Iterable | None, heldout: Any, text: Mapping[str, Any]
) -> tuple[Iterable | None, Iterable | None]:
    """``(calibration, held out)``: a float ``heldout`` holds out that
    fraction of raw ``data``'s samples, the last ones; anything else is read
    as batches with ``text``. Held-out texts are batched longest first
    (:meth:`TextData.by_length`)."""
    if isinstance(heldout, float):
        data, part = split_heldout(data, heldout)
        return data, part.by_length()
    held = None if heldout is None else as_batches(heldout, **text)
    return data, held.by_length() if isinstance(held, TextData) else held


def split_heldout(data: Iterable | None, fraction: float) -> tuple[TextData, TextData]:
    """Raw text ``data`` split into (calibration, the last ``fraction`` of its
    samples held out); batches cannot be split and raise ``ValueError``."""
    if not isinstance(data, TextData):
        raise ValueError(
            f"heldout={fraction} holds out a fraction of raw text data (with tokenizer=); "
            "with batches, pass held-out batches as heldout=..."
        )
    return data.split(fraction)


def _run_measured(
    method: Method, model: nn.Module, data: Iterable | None, config: Any, heldout: Iterable
) -> tuple[nn.Module, Report]:
    from toast.hf.evaluate.quality import Evaluator, Quality, skipped_blocks
    from toast.methods.driver import runner_of

    calibration = getattr(config, "calibration", None)
    evaluator = Evaluator(
        heldout,
        progress=getattr(calibration, "progress", True),
        compute=getattr(calibration, "compute_dtype", "auto"),
        calibration=calibration,  # its process group shards the held-out batches
    )
    original = evaluator.measure(model, "original")  # first: the reference of the fidelity
    metrics = {"original": evaluator.last}
    plain: list[float] = []

    def before_surgery(spans: Sequence[Span], stack: BlockStack) -> None:
        with skipped_blocks(stack, spans):
            plain.append(evaluator.measure(model, "plain removal"))
        metrics["plain_removal"] = evaluator.last

    model, report = runner_of(method)(model, data, config, before_surgery)
    compressed = evaluator.measure(model, "compressed")
    metrics["compressed"] = evaluator.last
    assert evaluator.metric is not None  # set by the first measurement
    report.quality = Quality(
        metric=evaluator.metric,
        original=original,
        compressed=compressed,
        plain_removal=plain[0] if plain else None,
        samples=evaluator.samples,
        count=evaluator.count,
        metrics=metrics,
        top_k=evaluator.top_k if evaluator.metric == "perplexity" else None,
    )
    return model, report
