"""The search knows no method: a method registered with stages joins it
(calibrated, proposed, built and measured) without touching the search."""

from __future__ import annotations

import dataclasses

import pytest

import toast
from toast.hf.model.surgery import remove_blocks
from toast.methods import available_methods, base
from toast.methods.base import BaseStages, Method, Needs, Plan, Stats

from .conftest import CALIBRATION_LENGTH, tiny_llama, token_batches

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.hf


@dataclasses.dataclass
class LastStats(Stats):
    rows: int = 0


class DropLast(BaseStages):
    """A toy method: remove the last ``n`` blocks, predicted by ``n``."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def needs(self, layout):
        return Needs(moments=True)

    def calibrate(self, model, data, layout, shared, calibration, max_blocks):
        self.calls.append("calibrate")
        return LastStats(rows=shared.moments.rows)

    def propose(self, stats, sizes, max_blocks, macs_matter):
        self.calls.append("propose")
        last = sizes.num_blocks
        return [
            Plan(("drop-last",), "drop-last", ((last - n, last),), "identity",
                 sizes.after_spans([(last - n, last)]), float(n))
            for n in range(1, max_blocks + 1)
        ]  # fmt: skip

    def apply(self, model, plan, stats, layout):
        self.calls.append("apply")
        remove_blocks(model, list(plan.spans), blocks=layout.stack)


def test_a_registered_method_joins_the_search(monkeypatch, tmp_path):
    available_methods()
    stages = DropLast()
    method = Method("drop-last", Stats, stages=stages)  # type: ignore[arg-type]
    monkeypatch.setitem(base._REGISTRY, "drop-last", method)
    data, heldout = token_batches(2, CALIBRATION_LENGTH, 1), token_batches(1, 12, 2)
    result = toast.search(
        tiny_llama(), data, heldout, target=0.2, cache=tmp_path, latency=False, progress=False,
        max_measured=40,
    )  # fmt: skip
    ours = [m for m in result.measured if m.candidate.family == "drop-last"]
    assert ours
    for m in ours:
        assert m.measurement.params == m.candidate.params_after
    assert stages.calls[:2] == ["calibrate", "propose"]
    assert stages.calls.count("apply") == len(ours)
    # the shared pass, and ReplaceMe's, sub-layer pruning's and LinearPatch's own
    assert result.calibration_passes == 4


def test_a_fresh_process_sees_every_staged_method_without_importing_one():
    # toast.search as a process's first call must see every method: the
    # registry loads them itself rather than relying on an earlier import
    import subprocess
    import sys

    code = (
        "from toast.methods.base import staged_methods; "
        "print(','.join(m.name for m in staged_methods()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().split(",") == sorted(toast.methods.available_methods())
