"""Adding a method touches its own package and one line of
``toast.methods.base.METHODS``: a toy method written as a package of its
own (config, its plans' part, stages, registration) compresses through ``toast.compress``
in memory and from a checkpoint folder, through ``toast.search`` and
through ``toast compress`` on the command line, with no framework change."""

from __future__ import annotations

import sys
import textwrap

import pytest

import toast

from ..frontier.conftest import CALIBRATION_LENGTH, tiny_llama, token_batches

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

#: The toy's package: it removes the last blocks asked for, needing no data.
PACKAGE = {
    "__init__.py": '"""A toy method: the last blocks go."""\n',
    "config.py": '''
        import dataclasses

        from toast.hf.data.calibration import Calibration


        @dataclasses.dataclass(frozen=True)
        class ToyConfig:
            """How many of the last blocks go."""

            num_blocks: int = 1
            calibration: Calibration = dataclasses.field(default_factory=Calibration)
        ''',
    "part.py": '''
        import dataclasses


        @dataclasses.dataclass(frozen=True)
        class ToyPart:
            """The toy's own setting in a plan: how many last blocks go."""

            count: int
            method = "toy"
            fixes_tokens = False

            def first_block(self):
                return None  # the spans say which blocks go

            def key(self):
                return f"last{self.count}"

            def label(self):
                return (f"the last {self.count}",)

            def entries(self):
                return {"toy_count": self.count}
        ''',
    "method.py": """
        from toast.hf.evaluate.from_disk import removal
        from toast.hf.model.surgery import remove_blocks
        from toast.io.pruned import write_pruned_checkpoint
        from toast.methods.base import BaseStages, Method, Plan, Stats, register

        from toy_method.config import ToyConfig
        from toy_method.part import ToyPart


        class ToyStages(BaseStages):
            from_disk = True

            def needs_data(self, request):
                return False

            def calibrate(self, model, data, layout, shared, calibration, max_blocks):
                return Stats()

            def calibrate_from_disk(self, disk, data, layout, shared, calibration, max_blocks):
                return Stats()

            def propose(self, stats, sizes, max_blocks, macs_matter):
                total = sizes.num_blocks
                return [
                    Plan(("toy",), "toy", ((total - n, total),), "identity",
                         sizes.after_spans(((total - n, total),)), float(n),
                         parts=(ToyPart(n),))
                    for n in range(1, max_blocks + 1)
                ]

            def apply(self, model, plan, stats, layout):
                remove_blocks(model, list(plan.spans), blocks=layout.stack)

            def edits(self, disk, plan, stats):
                return removal(plan.spans)

            def save_from_disk(self, disk, plan, stats, output, report=None):
                renames, kept = disk.renumbered(b for a, z in plan.spans for b in range(a, z))
                return write_pruned_checkpoint(disk.checkpoint, output, renames, kept=kept,
                                               total=disk.num_blocks, progress=False)


        METHOD = register(Method(name="toy", config=ToyConfig, needs_data=False,
                                 summary="the last blocks go", stages=ToyStages()))
        """,
}


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy package on the path and its one line in ``METHODS`` (the
    registry restored afterwards)."""
    from toast.methods import base

    package = tmp_path / "toy_method"
    package.mkdir()
    for name, text in PACKAGE.items():
        (package / name).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    monkeypatch.setitem(base.METHODS, "toy", ("toy_method.method", "toy_method.config:ToyConfig"))
    yield
    for name in [m for m in sys.modules if m.startswith("toy_method")]:
        del sys.modules[name]


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_method_added_as_a_package_and_one_line_compresses_everywhere(toy, tmp_path):
    from toast.cli import main

    model = tiny_llama()
    folder = tmp_path / "llama"
    model.save_pretrained(folder, max_shard_size="20KB")
    data, heldout = token_batches(4, CALIBRATION_LENGTH, 1), token_batches(2, 12, 2)
    expected, report = toast.compress(tiny_llama(), data, method="toy", num_blocks=2)
    assert report.plan.spans == ((4, 6),) and len(expected.model.layers) == 4
    # its own setting rides in its plans as its part, with no framework change
    assert report.plan.part("toy").count == 2 and report.plan.key == "toy|identity|4-6|||last2"
    assert report.plan.label == "toy: remove blocks[4:6], the last 2"
    # from a folder, block by block
    toast.compress(folder, data, method="toy", num_blocks=2, output=tmp_path / "disk",
                   sequential=True, progress=False)  # fmt: skip
    disk = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "disk")
    assert _same_weights(disk, expected)
    # the search, restricted to it
    found = toast.search(model, data, heldout, target="blocks=2", methods=["toy"],
                         max_measured=1, cache=False, latency=False, progress=False)  # fmt: skip
    assert _same_weights(found.model, expected)
    assert found.to_dict()["measured"][0]["toy_count"] == 2
    # the command line: its option from its config, no CLI code
    argv = ["compress", str(folder), "--method", "toy", "--num-blocks", "2"]
    assert main([*argv, "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
    cli = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
    assert _same_weights(cli, expected)


def test_a_method_without_a_report_of_its_own_reports_its_plan_and_quality(toy):
    from toast.methods.driver import PlanReport

    data, heldout = token_batches(2, CALIBRATION_LENGTH, 1), token_batches(2, 12, 2)
    compressed, report = toast.compress(
        tiny_llama(), data, method="toy", num_blocks=2, heldout=heldout, progress=False
    )
    assert isinstance(report, PlanReport) and report.plan.spans == ((4, 6),)
    assert report.params_after == toast.count_params(compressed) and report.blocks_removed == 2
    assert report.quality is not None and report.quality.plain_removal is not None
    assert report.quality_markdown() and report.to_markdown().endswith(report.quality_markdown())
