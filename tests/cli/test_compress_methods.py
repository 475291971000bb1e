"""``toast compress --method NAME``: every registered method is on the
command line with its config's options, and a run from the command line
gives the model :func:`toast.compress` gives."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
hf_models = pytest.importorskip("tests._helpers.hf_models")

import toast  # noqa: E402
from toast.cli import main  # noqa: E402
from toast.cli.compress import config_from_args  # noqa: E402
from toast.cli.main import _build_parser  # noqa: E402
from toast.cli.options import config_fields  # noqa: E402
from toast.methods import available_methods, method_config  # noqa: E402
from toast.methods.base import make_config  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SIZES = {
    "toast": {"num_blocks": 1},
    "replaceme": {"num_blocks": 1},
    "remove": {"num_blocks": 1},
    "linearpatch": {"num_blocks": 1},
    "sublayer": {"num_sublayers": 1},
}


@pytest.mark.parametrize("method", available_methods())
def test_every_method_is_reachable_and_its_defaults_are_its_configs(method):
    argv = ["compress", "m", "--method", method, "--out", "o", "--no-progress"]
    options = SIZES.get(method, {})  # the methods that remove blocks need a number of them
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    parsed = config_from_args(_build_parser(method).parse_args(argv))
    assert isinstance(parsed, method_config(method))
    expected = make_config(toast.methods.get_method(method), {"progress": False, **options})
    assert parsed == expected


def _help(method, capsys):
    """``toast compress --method METHOD --help``, as printed."""
    with pytest.raises(SystemExit):
        main(["compress", "--method", method, "--help"])
    return capsys.readouterr().out


def _unwrapped(text):
    """``text`` without its whitespace: argparse wraps help lines at spaces
    and hyphens to the terminal's width."""
    return "".join(text.split())


@pytest.mark.parametrize("method", available_methods())
def test_every_option_a_command_line_can_give_is_a_flag_with_its_configs_help(method, capsys):
    shown = _help(method, capsys)
    config = method_config(method)
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for name in config_fields(config):
        flag = name.replace("_", "-")
        negated = defaults.get(name) is True  # an alias (ToastConfig.budget) has no field
        assert f"--{'no-' if negated else ''}{flag}" in shown, name
        assert _unwrapped(config.HELP[name]) in _unwrapped(shown), name


@pytest.mark.parametrize("method", available_methods())
def test_every_option_a_command_line_can_give_has_help_on_its_config(method):
    # no fallback is allowed for a registered method: its name, default and
    # allowed values alone (what the CLI shows without a text) say too little
    config = method_config(method)
    missing = [name for name in config_fields(config) if not config.HELP.get(name)]
    assert missing == [], f"{config.__name__}.HELP lacks {missing}"


def test_an_options_help_is_read_from_its_config(monkeypatch, capsys):
    config = method_config("remove")
    monkeypatch.setitem(config.HELP, "selection", "a text only this test writes")
    assert _unwrapped("a text only this test writes") in _unwrapped(_help("remove", capsys))


def test_the_cli_holds_no_help_of_its_own_for_a_configs_options(monkeypatch, capsys):
    config = method_config("toast")
    texts = [_unwrapped(text) for text in config.HELP.values()]
    monkeypatch.setattr(config, "HELP", {})  # every option falls back to its name
    shown = _unwrapped(_help("toast", capsys))
    assert [text for text in texts if text in shown] == []
    assert "--max-errorMAX_ERRORmaxerror" in shown  # the fallback: the field's name


def test_num_blocks_for_toast_equals_its_other_name_budget():
    argv = ["compress", "m", "--out", "o", "--no-progress"]  # --method toast: the default
    parse = _build_parser("toast").parse_args
    by_num_blocks = config_from_args(parse([*argv, "--num-blocks", "2"]))
    assert by_num_blocks == config_from_args(parse([*argv, "--budget", "2"]))
    assert by_num_blocks == make_config(toast.methods.get_method("toast"),
                                        {"num_blocks": 2, "progress": False})  # fmt: skip


@pytest.mark.parametrize(("given", "expected"), [("4GiB", 4 << 30), ("auto", "auto")])
def test_statistics_bytes_takes_a_size_or_auto(given, expected):
    argv = ["compress", "m", "--method", "toast", "--budget", "2", "--out", "o"]
    parsed = _build_parser("toast").parse_args([*argv, "--statistics-bytes", given])
    assert config_from_args(parsed).statistics_bytes == expected


def test_toast_vit_from_the_command_line_gives_the_library_model(tmp_path):
    model = hf_models.build(hf_models.FAMILIES[0])  # a tiny ViT
    model.save_pretrained(tmp_path / "vit")
    model = toast.load_pretrained(tmp_path / "vit")  # as the command loads it
    out = tmp_path / "out"
    argv = ["compress", str(tmp_path / "vit"), "--method", "toast-vit", "--head-sparsity", "0.5"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    expected, _ = toast.compress(model, method="toast-vit", head_sparsity=0.5, progress=False)
    loaded = toast.load_pretrained(out)
    x = torch.randn(2, 3, hf_models.IMAGE, hf_models.IMAGE)
    with torch.no_grad():
        got, want = loaded(pixel_values=x), expected(pixel_values=x)
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)
    assert "SCWP" in (out / "report.md").read_text()


def test_a_method_that_needs_data_without_data_is_refused_before_loading(tmp_path, capsys):
    hf_models.build(hf_models.FAMILIES[0]).save_pretrained(tmp_path / "vit")
    argv = ["compress", str(tmp_path / "vit"), "--budget", "1", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "--method toast needs calibration data: pass --data" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_no_refit_keeps_the_fits_the_check_measured():
    argv = ["compress", "m", "--method", "toast", "--budget", "2", "--out", "o"]
    assert config_from_args(_build_parser("toast").parse_args(argv)).refit is True
    parsed = _build_parser("toast").parse_args([*argv, "--no-refit"])
    assert config_from_args(parsed).refit is False
