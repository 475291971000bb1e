"""ToaSt's typed config and its registration: every field is checked with
the package's one message format, ``toast.compress(method="toast-vit")``
builds the config from keywords and passes it to ToaSt's stages unchanged,
the report is a :class:`toast.methods.base.Report`, and ``calibration.seed``
seeds both TCS's token samples and the fine-tune."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import toast  # noqa: E402
from toast._validation import InvalidParameterError  # noqa: E402
from toast.hf.data.calibration import Calibration  # noqa: E402
from toast.hf.model.params import count_params  # noqa: E402
from toast.methods.base import Report, get_method  # noqa: E402
from toast.methods.driver import compress_with_stages, runner_of  # noqa: E402
from toast.methods.heads import ToastVitConfig, compress_vit  # noqa: E402
from toast.methods.heads.finetune import finetune  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

SCHEDULE = {"fc1": [0, 0, 0.5], "fc2": [0, 0.5, 0.9]}


def _classifier(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        image_size=16, patch_size=4, num_labels=5, hidden_dropout_prob=dropout,
    )  # fmt: skip
    return transformers.ViTForImageClassification(cfg).eval()


def _batch(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return x, torch.arange(n) % 5


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("center", "median", "center must be one of 'geomedian', "),
        ("index_sets", "shared2", "index_sets must be one of 'shared', "),
        ("coupling", "both", "coupling must be one of 'coupled', "),
        ("form", "sparse", "form must be one of 'dense', 'masked'; got 'sparse'"),
        ("tcs_scope", "all", "tcs_scope must be one of 'image', 'batch'; got 'all'"),
        ("tcs_form", "x", "tcs_form must be one of 'dense', 'masked'"),
        ("score", "eq5", "score must be one of 'auto', 'eq6', 'eq7'"),
        ("weights", "raw", "weights must be one of 'paper', 'normalized'"),
        ("hidden", "none", "hidden must be one of 'all', 'kept'"),
        ("head_sparsity", 1.0, r"head_sparsity must be a number in \[0, 1\) or "),
        ("head_sparsity", "0.5", "head_sparsity must be"),
        ("sample_ratio", 0.0, r"sample_ratio must be a number in \(0, 1\] or None"),
        ("skip", "stage_last", "skip must be a list of block indices or one of 'stage_first'"),
        ("skip", [0.5], "skip must be a list of block indices"),
        ("rescale", 1, "rescale must be a bool; got 1"),
        ("finetune_steps", -1, r"finetune_steps must be an int in \[0, inf\)"),
        ("lr", 0.0, r"lr must be a number in \(0, inf\)"),
        ("weight_decay", -1e-4, "weight_decay must be"),
        ("loss_fn", "mse", "loss_fn must be a callable"),
        ("image_size", 0, r"image_size must be an int in \[1, inf\) or None"),
        ("schedule", 3, "schedule must be a str or a Schedule or a Mapping or None"),
        ("calibration", {}, "calibration must be a Calibration"),
    ],
)
def test_every_field_is_checked(field, value, message):
    with pytest.raises(InvalidParameterError, match=message):
        ToastVitConfig(**{field: value})


def test_min_lr_above_lr_is_refused():
    with pytest.raises(ValueError, match="min_lr must be <= lr"):
        ToastVitConfig(lr=1e-4, min_lr=1e-3)


def test_defaults_and_accepted_forms():
    ToastVitConfig()
    ToastVitConfig(head_sparsity=[0.0, 0.5, 0.5], skip="stage_first", schedule="table11")
    ToastVitConfig(head_sparsity={1: 0.5}, skip=[], sample_ratio=1.0, finetune_steps=0)


def test_keywords_build_the_config_the_method_runs_with(monkeypatch):
    """toast.compress routes the calibration seed into ``calibration`` and
    hands the config, as it is (no re-mapping), to ToaSt's stages through
    the one driver (no ``run`` of its own)."""
    method = get_method("toast-vit")
    assert method.config is ToastVitConfig
    assert runner_of(method).func is compress_with_stages
    seen = {}
    configured = type(method.stages).configured

    def spy(self, config):
        seen["config"] = config
        return configured(self, config)

    monkeypatch.setattr(type(method.stages), "configured", spy)
    toast.compress(_classifier(), method="toast-vit", head_sparsity=0.5, seed=7, lr=2e-3)
    assert seen["config"] == ToastVitConfig(
        head_sparsity=0.5, lr=2e-3, calibration=Calibration(seed=7)
    )


def test_compress_vit_takes_the_config_and_reports_like_every_method():
    model = _classifier()
    before = count_params(model)
    config = ToastVitConfig(head_sparsity=0.5, schedule=SCHEDULE)
    out, report = compress_vit(model, None, config)
    assert out is model and isinstance(report, Report)
    assert (report.blocks_before, report.blocks_after, report.blocks_removed) == (3, 3, 0)
    assert report.params_before == before and report.params_after == count_params(model)
    assert report.compression_by_params == 1 - report.params_after / report.params_before > 0
    assert report.params_line() in report.to_markdown()
    # the same config through the registry gives the same model
    other, again = toast.compress(_classifier(), method="toast-vit", config=config)
    x, _ = _batch()
    torch.testing.assert_close(other(pixel_values=x).logits, model(pixel_values=x).logits)
    assert again.gmacs_after == report.gmacs_after


def test_seed_seeds_tcs_samples():
    """Eq. 6 scores on a seeded sample of patch tokens: the calibration
    seed is the TCS seed."""
    config = ToastVitConfig(schedule=SCHEDULE, sample_ratio=0.25, calibration=Calibration(seed=3))
    _, report = compress_vit(_classifier(), None, config)
    assert report.tcs is not None and report.tcs.options.seed == 3


def test_seed_makes_the_finetune_reproducible_and_leaves_torch_rng_alone():
    """With dropout the fine-tune draws random masks: the same seed gives the
    same losses, another seed others; the global generator is restored."""
    data = [_batch()]

    def losses(seed: int) -> list[float]:
        model = _classifier(dropout=0.3)
        state = torch.get_rng_state()
        config = ToastVitConfig(
            head_sparsity=0.5, finetune_steps=3, calibration=Calibration(seed=seed)
        )
        out = compress_vit(model, data, config)[1].finetune_losses
        assert torch.equal(torch.get_rng_state(), state)
        return out

    first = losses(1)
    assert losses(1) == first and losses(2) != first


def test_finetune_checks_its_arguments():
    model = _classifier()
    with pytest.raises(InvalidParameterError, match=r"steps must be an int in \[1, inf\)"):
        finetune(model, [_batch()], steps=0)
    with pytest.raises(InvalidParameterError, match=r"min_lr must be a number in \[0, 0.001\]"):
        finetune(model, [_batch()], steps=1, lr=1e-3, min_lr=1e-2)
