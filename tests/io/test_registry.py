"""toast.io.registry: a method's own block kind saves and reloads through a
registered serializer; a plan naming an unknown kind is refused."""

import json

import pytest

torch = pytest.importorskip("torch")
hf_models = pytest.importorskip("tests._helpers.hf_models")

from toast.hf.model.blocks import find_blocks  # noqa: E402
from toast.hf.model.surgery import _install_blocks  # noqa: E402
from toast.io import (  # noqa: E402
    PLAN_NAME,
    CorruptedSaveError,
    load_pretrained,
    registry,  # noqa: E402
    save_pretrained,
)


class ScaleBlock(torch.nn.Module):
    """A stand-in for a method's own block: hidden states times a learned vector."""

    _toast_stand_in = True  # not one of the model's own blocks (see find_blocks)

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(dim))

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states * self.scale


def _check(entry):
    if not isinstance(entry.get("dim"), int):
        raise ValueError("'dim' must be an int")


SCALE = registry.BlockSerializer(
    type="scale",
    claims=lambda block: isinstance(block, ScaleBlock),
    describe=lambda block: {"dim": int(block.scale.shape[0])},
    check=_check,
    build=lambda entry: ScaleBlock(entry["dim"]),
)


@pytest.fixture
def scale_serializer(monkeypatch):
    monkeypatch.setitem(registry._SERIALIZERS, "scale", SCALE)
    return SCALE


def _model_with_a_scale_block():
    family = hf_models.FAMILIES[0]
    model = hf_models.build(family).eval()
    stack = find_blocks(model)
    block = ScaleBlock(hf_models.HIDDEN)
    with torch.no_grad():
        block.scale.copy_(torch.linspace(0.5, 1.5, hf_models.HIDDEN))
    blocks = list(stack.blocks)
    blocks[1] = block
    _install_blocks(model, stack, blocks, list(range(len(blocks))))
    return model, hf_models.loader(family, 4, batch_size=4)[0]


def test_a_registered_block_kind_reloads_with_identical_outputs(tmp_path, scale_serializer):
    model, images = _model_with_a_scale_block()
    save_pretrained(model, tmp_path / "m")
    plan = json.loads((tmp_path / "m" / PLAN_NAME).read_text())
    assert plan["layout"][1] == {"type": "scale", "dim": hf_models.HIDDEN}
    loaded = load_pretrained(tmp_path / "m")
    assert isinstance(find_blocks(loaded).blocks[1], ScaleBlock)
    with torch.no_grad():
        expected = model(pixel_values=images).last_hidden_state
        got = loaded(pixel_values=images).last_hidden_state
    assert torch.equal(expected, got)


def test_a_plan_naming_an_unregistered_kind_is_corrupted(tmp_path, scale_serializer, monkeypatch):
    model, _ = _model_with_a_scale_block()
    save_pretrained(model, tmp_path / "m")
    monkeypatch.delitem(registry._SERIALIZERS, "scale")
    with pytest.raises(CorruptedSaveError, match=r"layout\[1\] has no known block type: 'scale'"):
        load_pretrained(tmp_path / "m")


def test_a_malformed_entry_is_refused_by_its_serializer(tmp_path, scale_serializer):
    model, _ = _model_with_a_scale_block()
    save_pretrained(model, tmp_path / "m")
    file = tmp_path / "m" / PLAN_NAME
    plan = json.loads(file.read_text())
    plan["layout"][1]["dim"] = "wide"
    file.write_text(json.dumps(plan))
    with pytest.raises(CorruptedSaveError, match=r"layout\[1\]: 'dim' must be an int"):
        load_pretrained(tmp_path / "m")


def test_the_block_type_of_the_model_itself_cannot_be_taken():
    with pytest.raises(ValueError, match="reserved"):
        registry.register_block_serializer(
            registry.BlockSerializer("block", bool, dict, _check, ScaleBlock)
        )


def test_a_second_model_patch_of_one_type_is_refused():
    def nothing(*args):
        return None

    assert registry.patch_named("toast-vit") is not None  # ToaSt's, loaded if it was not
    patch = registry.ModelPatch(type="toast-vit", describe=nothing, check=nothing, finish=nothing)
    with pytest.raises(ValueError, match="'toast-vit' is registered already"):
        registry.register_model_patch(patch)


_DISCOVER = """
import json, sys
from toast.io import registry
before = "toast.methods.heads.persist" in sys.modules
found = registry.patch_named("toast-vit")
print(json.dumps({"before": before, "found": found is not None and found.type == "toast-vit"}))
"""


def test_a_patch_type_is_found_through_its_entry_point_without_importing_methods():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _DISCOVER], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"before": False, "found": True}
