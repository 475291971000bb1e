"""Progress of a pass over data (``toast.hf.data.progress``): totals in samples,
tokens, an ETA, and plain lines when stderr is not a terminal."""

import io

import pytest

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("tests._helpers.hf_models")

import toast  # noqa: E402
from toast.hf.data.progress import LineProgress, expected_samples  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def test_line_progress_writes_lines_with_the_total_and_an_eta():
    out = io.StringIO()
    bar = LineProgress("capturing", total=6, unit="sample", file=out, interval=0)
    for _ in range(3):
        bar.set_postfix(tokens="1,000")
        bar.update(2)
    bar.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0].startswith("capturing: 2/6 samples, tokens=1,000") and "ETA" in lines[0]
    assert lines[-1].startswith("capturing: 6/6 samples")


def test_line_progress_throttles_but_always_writes_the_last_count():
    out = io.StringIO()
    bar = LineProgress("capturing", total=None, unit="sample", file=out, interval=3600)
    for _ in range(100):
        bar.update(1)
    bar.close()
    assert out.getvalue().splitlines() == [
        out.getvalue().splitlines()[0],
        out.getvalue().splitlines()[-1],
    ]
    assert out.getvalue().splitlines()[-1].startswith("capturing: 100 samples")


@pytest.mark.parametrize(
    "loader,max_samples,max_batches,expected",
    [
        (torch.utils.data.DataLoader(list(range(10)), batch_size=4), None, None, 10),
        (torch.utils.data.DataLoader(list(range(10)), batch_size=4), None, 2, 8),
        ([0, 0, 0], None, None, 12),  # three batches of the first batch's 4 samples
        ([0, 0, 0], 5, None, 5),
        (iter([0, 0]), None, None, None),  # no length: no total
    ],
)
def test_expected_samples(loader, max_samples, max_batches, expected):
    assert expected_samples(loader, max_samples, max_batches, batch=4) == expected


def test_a_pass_logged_to_a_file_counts_samples_and_tokens_without_redraws(capsys):
    vit = hf_models.FAMILIES[0]
    toast.analyze(hf_models.build(vit), hf_models.loader(vit, 8, 4), estimator="gcv")
    err = capsys.readouterr().err  # not a terminal under pytest
    assert "\r" not in err
    final = [line for line in err.splitlines() if line.startswith("capturing:")][-1]
    # 8 images of 16 patches + CLS = 136 token rows, all of them in the last line
    assert final.startswith("capturing: 8/8 samples, tokens=136,")
