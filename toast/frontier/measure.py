"""What a search measures of each built model: held-out quality, exact
parameters, linear-layer MACs on the example batch, and throughput on the
device the model runs on."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from toast.hf.capture.distributed import broadcast_object
from toast.hf.evaluate.quality import Evaluator
from toast.hf.model.params import count_params
from toast.linear_macs import linear_macs

from .latency import measure_throughput

__all__ = ["Measurement", "measure", "timed"]


@dataclass(frozen=True)
class Measurement:
    """One model measured: ``quality`` in ``metric``; ``macs`` per sample
    of the ``nn.Linear`` layers on the example batch, as
    ``toast.macs(model, convention="linear", example=...)`` counts them
    (attention's own products, which every plan keeps per kept block, are
    not counted; None where they were not counted: block by block from
    disk); ``throughput`` a :class:`toast.frontier.latency.Throughput` as a dict
    (None when latency was not measured); ``seconds`` what measuring took;
    ``metrics`` every metric of the held-out pass
    (:attr:`toast.hf.evaluate.quality.Evaluator.last`: fidelity to the
    original besides ``quality``; empty where not measured); ``documents``
    each task's per-document scores under a task objective, in the
    harness's document order (for the paired standard error of two
    candidates' accuracies; empty otherwise)."""

    quality: float
    metric: str
    params: int
    macs: int | None
    throughput: dict[str, Any] | None
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    documents: dict[str, list[float]] = field(default_factory=dict)

    @property
    def forward_per_s(self) -> float | None:
        return None if self.throughput is None else float(self.throughput["forward_per_s"])

    def speedup(self, original: Measurement) -> float | None:
        """Forward throughput relative to the original's: to the original
        timed in the same rounds when it was (see :func:`paired_throughput`)."""
        if self.throughput is None:
            return None
        base = self.throughput.get("reference_forward_per_s") or original.forward_per_s
        return None if not base else float(self.throughput["forward_per_s"]) / base

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        # entries cached before the metrics were measured have none
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def _options(example: Any) -> dict[str, Any]:
    # one sequence for text models: a request's latency, and cheap enough to
    # time every candidate beside the original; image batches as they come
    text = isinstance(example, dict) and "input_ids" in example
    return {"batch_size": 1, "new_tokens": 16} if text else {}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def paired_throughput(
    model: nn.Module,
    reference: nn.Module | None,
    example: Any,
    rounds: int = 3,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """``model``'s throughput, timed in rounds that alternate with
    ``reference`` (the original) so that both see the same machine load;
    medians of the rounds, the reference's under ``reference_*``. Without
    a reference, ``model`` alone. ``batch_size``: timed at that batch
    (``example``'s rows repeated to fill it; default as it comes, one
    sequence for text)."""
    options = _options(example)
    if batch_size is not None:
        options["batch_size"] = batch_size
    if reference is None:
        return measure_throughput(model, example, rounds=rounds, **options).to_dict()
    own: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    for r in range(rounds):
        warm = 1 if r == 0 else 0
        other.append(
            measure_throughput(reference, example, rounds=1, warmup=warm, **options).to_dict()
        )
        own.append(measure_throughput(model, example, rounds=1, warmup=warm, **options).to_dict())
    result = dict(own[0], rounds=rounds)
    for key in ("forward_per_s", "decode_tokens_per_s"):
        result[key] = _median([t[key] for t in own])
        result[f"reference_{key}"] = _median([t[key] for t in other])
    return result


def measure(
    model: nn.Module,
    evaluator: Evaluator,
    example: Any,
    label: str,
    latency: bool | int = True,
    reference: nn.Module | None = None,
    macs: int | None = None,
    phases: dict[str, float] | None = None,
    rounds: int = 3,
    heldout: Callable[[nn.Module, str], float] | None = None,
) -> Measurement:
    """``model`` measured on the evaluator's held-out data and ``example``
    (throughput paired with ``reference``'s, see :func:`paired_throughput`,
    at the batch size ``latency`` gives when it is an int;
    ``macs``: counted already, where the linear layers' hooks cannot see
    them, as in Token Channel Selection's gathered products). ``phases``
    gets the seconds of each part under ``"<label>: held-out"``,
    ``"<label>: latency"`` and ``"<label>: MACs"``; ``rounds``: the paired
    timing rounds; ``heldout``: runs the evaluator's pass (default
    ``evaluator.measure``; the search's bench resumes it part way down the
    blocks), the timing and the MACs always see the whole model."""
    start = time.perf_counter()
    times = phases if phases is not None else {}
    with timed(times, f"{label}: held-out"):
        quality = (heldout or evaluator.measure)(model, label)
    assert evaluator.metric is not None  # set by the measurement
    throughput = None
    if latency:
        with timed(times, f"{label}: latency"):
            batch = None if isinstance(latency, bool) else latency
            throughput = paired_throughput(model, reference, example, rounds, batch_size=batch)
        if evaluator.ranks is not None:
            # timings differ between processes: rank 0's, so that every rank
            # ranks the candidates (a latency target, the front) alike
            throughput = broadcast_object(throughput, evaluator.ranks)
    if macs is None:
        with timed(times, f"{label}: MACs"):
            macs = linear_macs(model, example)
    return Measurement(
        quality=float(quality),
        metric=evaluator.metric,
        params=count_params(model),
        macs=macs,
        throughput=throughput,
        seconds=time.perf_counter() - start,
        metrics=dict(evaluator.last),
    )


@contextlib.contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Adds the seconds the block takes to ``phases[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
