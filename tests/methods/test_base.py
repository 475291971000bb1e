"""The method registry and toast.compress's dispatch through it."""

import dataclasses

import pytest

import toast
from toast.hf.data.calibration import Calibration
from toast.methods import available_methods
from toast.methods.base import Method, Report, get_method, make_config, register
from toast.methods.stages import BaseStages, Plan, Request
from toast.methods.translate.config import ToastConfig


def test_every_method_is_registered():
    expected = ["atm", "linearpatch", "pitome", "rapid", "remove", "replaceme", "sublayer"]
    expected += ["toast"]
    expected += ["toast-vit", "token-transforming", "tome"]
    assert available_methods() == expected


def test_every_registered_method_has_stages_the_search_can_run():
    from toast.methods.base import Stages

    for name in available_methods():
        assert isinstance(get_method(name).stages, Stages), name


def test_an_unknown_method_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"method must be one of \['atm', 'linearpatch', 'pitome'"):
        toast.compress(object(), [], method="prune")


def test_make_config_routes_calibration_options_into_the_calibration_field():
    config = make_config(get_method("toast"), {"budget": 2, "max_samples": 7, "seed": 3})
    assert isinstance(config, ToastConfig)
    assert config.num_blocks == 2
    assert config.calibration == Calibration(max_samples=7, seed=3)


def test_make_config_names_options_the_method_does_not_have():
    with pytest.raises(TypeError, match=r"method='toast' has no option\(s\) \['num_cuts'\]"):
        make_config(get_method("toast"), {"num_blocks": 1, "num_cuts": 2})


def test_a_config_object_and_keywords_are_not_mixed():
    with pytest.raises(TypeError, match="not both"):
        toast.compress(object(), [], config=ToastConfig(budget=1), budget=2)


def test_a_config_of_another_method_is_refused():
    with pytest.raises(TypeError, match="method='replaceme' takes a ReplaceMeConfig"):
        toast.compress(object(), [], method="replaceme", config=ToastConfig(budget=1))


def test_a_method_that_needs_data_refuses_none():
    with pytest.raises(ValueError, match="needs calibration data"):
        toast.compress(object(), None, budget=1)


def test_registering_a_second_method_of_the_same_name_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Config:
        pass

    with pytest.raises(ValueError, match="registered already"):
        register(Method(name="toast", config=Config, stages=BaseStages()))  # type: ignore[arg-type]


def test_a_registered_method_runs_through_compress(monkeypatch):
    pytest.importorskip("transformers")
    from toast.methods import base

    from ..frontier.conftest import tiny_llama

    @dataclasses.dataclass
    class Done(Report):
        method: str = "noop"
        blocks_before: int = 4
        blocks_after: int = 3
        params_before: int = 100
        params_after: int = 75

        def to_markdown(self) -> str:
            return self.params_line()

    @dataclasses.dataclass(frozen=True)
    class NoopConfig:
        factor: int = 1
        calibration: Calibration = dataclasses.field(default_factory=Calibration)

    seen = {}

    class NoopStages(BaseStages):
        """A method whose config fixes its plan: nothing removed, nothing captured."""

        def configured(self, config):
            seen["config"] = config
            return self

        def request(self, config):
            return Request()

        def needs_data(self, request):
            return False

        def propose(self, stats, sizes, max_blocks, macs_matter):
            return [Plan(("noop",), "noop", (), None, sizes.params, 0.0)]

        def choose(self, plans, request):
            return plans[0]

        def apply(self, model, plan, stats, layout):
            seen["applied"] = plan.family

        def report(self, plan, stats, sizes, spans, params_after):
            return Done()

    noop = Method(name="noop", config=NoopConfig, stages=NoopStages())
    monkeypatch.setitem(base._REGISTRY, "noop", noop)
    model = tiny_llama()
    out, report = toast.compress(model, [1], method="noop", factor=2, max_batches=1)
    assert out is model and seen["config"] == NoopConfig(2, Calibration(max_batches=1))
    assert seen["applied"] == "noop"
    assert report.blocks_removed == 1 and report.compression_by_blocks == 0.25
    assert report.to_markdown() == "Parameters: 100 → 75 (−25.0%)"


def test_toast_config_checks_cross_field_rules():
    with pytest.raises(ValueError, match="not both"):
        ToastConfig(budget=1, spans=[(1, 2)])
    with pytest.raises(ValueError, match="give num_blocks="):
        ToastConfig()
    with pytest.raises(ValueError, match="translator must be one of"):
        ToastConfig(budget=1, translator="conv")
