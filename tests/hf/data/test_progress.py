"""Progress of a pass over data (``toast.hf.data.progress``): totals in samples,
tokens, an ETA, and plain lines when stderr is not a terminal."""

import io

import pytest

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("tests._helpers.hf_models")

import toast  # noqa: E402
from toast.hf.data.progress import LineProgress, expected_samples, progress_iter  # noqa: E402

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


def test_progress_iter_yields_every_item_and_logs_plain_lines_when_redirected(capsys):
    # capsys's stderr is not a terminal: plain lines, the last with the total
    assert list(progress_iter(range(5), "writing shards", 5, "shard", disable=False)) == [
        0,
        1,
        2,
        3,
        4,
    ]
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines()[-1].startswith("writing shards: 5/5 shards")


def test_progress_iter_closes_its_bar_when_the_loop_stops_early(capsys):
    for item in progress_iter(range(10), "training", 10, "step", disable=False):
        if item == 2:
            break
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("training: 2/10 steps")


def test_the_last_count_is_written_once_and_units_are_plural():
    out = io.StringIO()
    bar = LineProgress("running", total=2, unit="batch", file=out, interval=0)
    bar.update(1)
    bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "running: 1/2 batches",
        "running: 2/2 batches",
    ]
