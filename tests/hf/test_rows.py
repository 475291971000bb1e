"""The disk-backed row sample and the trained translators fitted on it."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from toast.hf.rows import RowSample  # noqa: E402
from toast.translators import (  # noqa: E402
    MLPTranslator,
    ResMLPTranslator,
    build_translator,
    train_translator,
    translator_spec,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _pairs(n, d, start=0):
    # Row r of state 0 is r + start everywhere; state 1 is its negation, so
    # every kept row shows whether its pair stayed together.
    x = np.repeat(np.arange(start, start + n, dtype=np.float32)[:, None], d, axis=1)
    return x, -x


def test_rows_under_capacity_are_kept_in_order(tmp_path):
    with RowSample(2, 3, capacity=10, directory=tmp_path, verbose=False) as s:
        s.add(_pairs(4, 3))
        s.add(_pairs(3, 3, start=4))
        assert s.rows == 7
        np.testing.assert_array_equal(s.state(0)[:, 0], np.arange(7))


def test_reservoir_keeps_capacity_rows_with_pairs_aligned(tmp_path):
    with RowSample(2, 3, capacity=50, directory=tmp_path, verbose=False) as s:
        for b in range(20):
            s.add(_pairs(37, 3, start=37 * b))
        assert (s.seen, s.rows) == (740, 50)
        x, y = s.state(0), s.state(1)
        np.testing.assert_array_equal(x, -y)
        assert len(np.unique(x[:, 0])) == 50  # sampled without replacement


def test_reservoir_is_uniform_over_all_rows(tmp_path):
    # Over many seeds every row is kept with probability capacity / seen; the
    # first and the last quarter of the stream are kept equally often.
    first = last = 0
    for seed in range(200):
        with RowSample(1, 1, capacity=20, directory=tmp_path, seed=seed, verbose=False) as s:
            for b in range(10):
                s.add([np.arange(20 * b, 20 * b + 20, dtype=np.float32)[:, None]])
            kept = s.state(0)[:, 0]
            first += int((kept < 50).sum())
            last += int((kept >= 150).sum())
    expected = 200 * 20 * 50 / 200
    assert abs(first - expected) < 0.15 * expected
    assert abs(last - expected) < 0.15 * expected


def test_same_seed_gives_the_same_sample(tmp_path):
    kept = []
    for _ in range(2):
        with RowSample(2, 2, capacity=16, directory=tmp_path, seed=7, verbose=False) as s:
            for b in range(5):
                s.add(_pairs(11, 2, start=11 * b))
            kept.append(np.array(s.state(0)))
    np.testing.assert_array_equal(kept[0], kept[1])


def test_buffer_size_is_printed_and_the_file_removed_on_close(tmp_path, capsys):
    s = RowSample(2, 8, capacity=1000, directory=tmp_path)
    assert "62.5 KiB" in capsys.readouterr().err
    s.add(_pairs(5, 8))
    assert len(os.listdir(tmp_path)) == 1
    s.close()
    assert os.listdir(tmp_path) == []


def test_bad_rows_are_rejected(tmp_path):
    with RowSample(2, 3, capacity=4, directory=tmp_path, verbose=False) as s:
        with pytest.raises(ValueError, match="expected 2 states"):
            s.add([np.zeros((2, 3))])
        with pytest.raises(ValueError, match=r"\(n, 3\)"):
            s.add([np.zeros((2, 4)), np.zeros((2, 4))])
    with pytest.raises(ValueError, match="capacity"):
        RowSample(2, 3, capacity=0, directory=tmp_path)


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
