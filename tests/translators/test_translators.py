"""Trained translators (MLP, Res-MLP) and the JSON specs that rebuild them."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests._helpers.kinds import spec_of  # noqa: E402
from toast.core import Translator  # noqa: E402
from toast.core.kinds import KINDS, Kind, kind_names  # noqa: E402
from toast.hf.capture.rows import RowSample  # noqa: E402
from toast.translators import (  # noqa: E402
    DiagonalMap,
    MLPTranslator,
    ResMLPTranslator,
    build_translator,
    train_translator,
    translator_module,
    translator_spec,
)
from toast.translators.modules import FITTED_KIND, LINEAR_KINDS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _linear_task(n=512, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    # rank d/2: within reach of the MLP's d/2 bottleneck
    w = torch.randn(d, d // 2, generator=gen) @ torch.randn(d // 2, d, generator=gen) / d
    return x, x @ w + 0.1


@pytest.mark.parametrize("kind", ["mlp", "resmlp"])
def test_training_reduces_the_error_well_below_the_untrained_module(kind):
    x, y = _linear_task()
    untrained = train_translator(x, y, kind, steps=1, lr=1e-12, progress=False)
    trained = train_translator(x, y, kind, steps=300, lr=1e-2, progress=False)
    with torch.no_grad():
        before = torch.nn.functional.mse_loss(
            untrained(x.to(untrained_dtype(untrained))), y.double()
        )
        after = torch.nn.functional.mse_loss(trained(x.to(untrained_dtype(trained))), y.double())
    assert after < 0.3 * before
    assert not trained.training


def untrained_dtype(module):
    return next(module.parameters()).dtype


def test_resmlp_trains_in_float64_and_mlp_in_float32_by_default():
    x, y = _linear_task(n=32)
    assert untrained_dtype(train_translator(x, y, "resmlp", steps=1, progress=False)) == (
        torch.float64
    )
    assert untrained_dtype(train_translator(x, y, "mlp", steps=1, progress=False)) == torch.float32


def test_training_is_deterministic_for_a_seed_with_minibatches():
    x, y = _linear_task()
    a = train_translator(x, y, "resmlp", steps=20, batch_size=64, seed=3, progress=False)
    b = train_translator(
        x.numpy(), y.numpy(), "resmlp", steps=20, batch_size=64, seed=3, progress=False
    )
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


def test_training_reads_rows_from_the_disk_buffer(tmp_path):
    x, y = _linear_task(n=100)
    with RowSample(2, 8, capacity=100, directory=tmp_path, verbose=False) as s:
        s.add([x, y])
        from_disk = train_translator(
            s.state(0), s.state(1), "mlp", steps=5, batch_size=30, progress=False
        )
    in_memory = train_translator(x, y, "mlp", steps=5, batch_size=30, progress=False)
    for pa, pb in zip(from_disk.parameters(), in_memory.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kind": "cnn"}, "kind"),
        ({"steps": 0}, "steps"),
        ({"lr": 0.0}, "lr"),
        ({"batch_size": 0}, "batch_size"),
    ],
)
def test_bad_training_arguments_are_rejected(kwargs, match):
    x, y = _linear_task(n=16)
    with pytest.raises(ValueError, match=match):
        train_translator(x, y, **{"kind": "mlp", **kwargs}, progress=False)


def test_mismatched_rows_are_rejected():
    with pytest.raises(ValueError, match="one shape"):
        train_translator(np.zeros((4, 3)), np.zeros((5, 3)), progress=False)


@pytest.mark.parametrize(
    "module",
    [
        MLPTranslator(6),
        MLPTranslator(6, hidden=5),
        ResMLPTranslator(6, dropout=0.1),
        torch.nn.Linear(6, 6, bias=False),
        torch.nn.Identity(),
    ],
    ids=["mlp", "mlp-hidden", "resmlp", "linear", "identity"],
)
def test_a_spec_rebuilds_the_same_structure(module):
    rebuilt = build_translator(translator_spec(module))
    assert type(rebuilt) is type(module)
    shapes = [p.shape for p in module.parameters()]
    assert [p.shape for p in rebuilt.parameters()] == shapes
    rebuilt.load_state_dict(module.state_dict())
    x = torch.randn(3, 6)
    module.eval(), rebuilt.eval()
    torch.testing.assert_close(rebuilt(x), module(x), rtol=0, atol=0)


def test_unknown_specs_are_rejected():
    with pytest.raises(ValueError, match="unknown translator kind"):
        build_translator({"kind": "conv"})
    with pytest.raises(ValueError, match="lacks 'dim'"):
        build_translator({"kind": "mlp", "hidden": 3})
    with pytest.raises(TypeError, match="cannot describe"):
        translator_spec(torch.nn.ReLU())


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_spec_of_every_kind_rebuilds_a_module_of_its_shape_under_its_name(kind):
    spec = spec_of(kind, 6)
    rebuilt = build_translator(spec)
    assert translator_spec(rebuilt) == spec
    assert translator_spec(build_translator(translator_spec(rebuilt))) == spec


def test_a_kind_the_table_stores_as_another_shape_is_not_named_by_a_module():
    # a Linear tagged "diagonal" would save a spec its loader rebuilds as a DiagonalMap
    linear = torch.nn.Linear(6, 6)
    setattr(linear, FITTED_KIND, "diagonal")
    assert translator_spec(linear)["kind"] == "linear"


def test_the_linear_kinds_are_those_the_table_stores_as_linear():
    assert LINEAR_KINDS == kind_names(module="linear")


def test_a_kind_added_to_the_table_keeps_its_name_through_a_spec(monkeypatch):
    monkeypatch.setitem(KINDS, "made_up", Kind("made_up", "diagonal"))
    rebuilt = build_translator(spec_of("made_up", 6))
    assert isinstance(rebuilt, DiagonalMap) and translator_spec(rebuilt)["kind"] == "made_up"


def test_a_closed_form_translator_becomes_the_module_of_its_kind():
    d = 6
    for kind in kind_names(fit="moments"):
        module = translator_module(Translator(kind, np.eye(d), np.ones(d), 1.0, d, "none"))
        assert translator_spec(module)["kind"] == kind
        assert type(module) is type(build_translator(spec_of(kind, d))), kind


@pytest.mark.parametrize("kind", kind_names(fit="trained"))
def test_every_trained_kind_trains_the_module_its_spec_rebuilds(kind):
    x, y = _linear_task(n=32)
    module = train_translator(x, y, kind, steps=1, progress=False)
    assert translator_spec(module)["kind"] == kind
    assert type(module) is type(build_translator(spec_of(kind, x.shape[1])))
