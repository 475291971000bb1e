"""Saved folders loaded in fresh processes: with toast, and where toast
cannot be imported (a ``sys.meta_path`` finder refuses it, as if it were not
installed; the child asserts that it is refused)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

import toast  # noqa: E402
from tests._helpers import hf_models as H  # noqa: E402

pytestmark = [
    pytest.mark.hf,
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.filterwarnings("ignore::toast.core.IllConditionedWarning"),
]

# Makes `import toast` fail as it does where toast is not installed.
_NO_TOAST = """
import sys
class _NoToast:
    def find_spec(self, name, path=None, target=None):
        if name == "toast" or name.startswith("toast."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _NoToast())
try:
    import toast
    raise SystemExit("toast is importable")
except ModuleNotFoundError:
    pass
"""


def _child(script: str, *args, tmp_path, block_toast: bool) -> dict:
    """Runs ``script`` in a fresh interpreter from ``tmp_path``; returns the
    JSON object of its last output line."""
    # One thread, as the parent (one_torch_thread): same kernels, same bits.
    prelude = "import torch\ntorch.set_num_threads(1)\n"
    code = (_NO_TOAST if block_toast else "") + prelude + textwrap.dedent(script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "hf_modules")
    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_LOAD_TEXT = """
import json, sys, torch
from transformers import AutoModel
folder = sys.argv[1]
saved = torch.load(folder + "/../expected.pt")
result = {"toast_loaded": "toast" in sys.modules}
try:
    AutoModel.from_pretrained(folder, trust_remote_code=False)
    result["plain"] = "loaded"
except ValueError as exc:
    result["plain"] = str(exc)
model = AutoModel.from_pretrained(folder, trust_remote_code=True)
with torch.no_grad():
    out = model(**saved["batch"]).last_hidden_state
result["equal"] = bool(torch.equal(out, saved["out"]))
result["block"] = type(model.encoder.layer[3]).__name__
print(json.dumps(result))
"""


def test_custom_save_rebuilds_without_toast_through_trust_remote_code(tmp_path):
    family = next(f for f in H.FAMILIES if f.name == "bert")
    model = H.build(family)
    data = H.loader(family, 32, 8)
    model, _ = toast.compress(model, data, spans=[(3, 4)], progress=False)
    model.save_pretrained(tmp_path / "saved")
    batch = data[0]
    with torch.no_grad():
        out = model(**batch).last_hidden_state
    torch.save({"batch": dict(batch), "out": out}, tmp_path / "expected.pt")
    result = _child(_LOAD_TEXT, tmp_path / "saved", tmp_path=tmp_path, block_toast=True)
    assert result["toast_loaded"] is False
    assert "trust_remote_code=True" in result["plain"]  # refused, not silently different
    assert result["equal"] and result["block"] == "TranslatorBlock"


def _deit_small(image_size: int = 64) -> torch.nn.Module:
    """DeiT-S's shape (width 384, 12 blocks, 6 heads, MLP 1536, patch 16) at
    a small image size."""
    config = transformers.DeiTConfig(
        hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
        image_size=image_size, patch_size=16,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.DeiTModel(config, add_pooling_layer=False).eval()


_LOAD_TCS = """
import json, sys, torch
import toast
from toast.methods.heads.tcs import tcs_ratios
folder = sys.argv[1]
saved = torch.load(folder + "/../expected.pt")
model = toast.load_pretrained(folder)
with torch.no_grad():
    out = model(pixel_values=saved["x"]).last_hidden_state
ratios = {str(b): list(r) for b, r in tcs_ratios(model).items()}
print(json.dumps({"equal": bool(torch.equal(out, saved["out"])), "ratios": ratios}))
"""


@pytest.fixture(scope="module")
def deit_tcs_save(tmp_path_factory):
    """A DeiT-S-shaped model compressed by ToaSt (head pruning + TCS,
    schedule deit_small@2.5), saved, with its outputs on 2 images."""
    root = tmp_path_factory.mktemp("deit")
    model, report = toast.compress(
        _deit_small(), method="toast-vit", schedule="deit_small@2.5", progress=False
    )
    assert report.tcs is not None
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(pixel_values=x).last_hidden_state
    toast.save_pretrained(model, root / "saved")
    torch.save({"x": x, "out": out}, root / "expected.pt")
    ratios = {str(b): list(r) for b, r in toast.methods.heads.tcs.tcs_ratios(model).items()}
    return root, ratios


def test_toast_vit_deit_small_reloads_in_a_fresh_process_with_tcs(deit_tcs_save):
    root, ratios = deit_tcs_save
    result = _child(_LOAD_TCS, root / "saved", tmp_path=root, block_toast=False)
    assert result["ratios"] == ratios and len(ratios) > 0  # TCS enabled again from the plan
    assert result["equal"]


_REMOTE_TCS = """
import json, sys
from transformers import AutoModel
try:
    AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True)
    print(json.dumps({"error": None}))
except ImportError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def test_tcs_save_without_toast_is_refused_naming_toast(deit_tcs_save):
    root, _ = deit_tcs_save
    result = _child(_REMOTE_TCS, root / "saved", tmp_path=root, block_toast=True)
    assert "Token Channel Selection" in result["error"] and "pip install toast" in result["error"]


_REPLACE_ONLY = """
import json, sys, torch
import transformers
from toast.hf.model.surgery import replace_spans  # shared infrastructure alone
config = transformers.BertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                 intermediate_size=64, vocab_size=97)
model = transformers.BertModel(config, add_pooling_layer=False)
replace_spans(model, [(1, 3)], [torch.nn.Linear(32, 32)])
assert "toast.io" not in sys.modules
try:
    model.save_pretrained(sys.argv[1])
    print(json.dumps({"error": None}))
except TypeError as exc:
    print(json.dumps({"error": str(exc), "written": __import__("os").path.exists(sys.argv[1])}))
"""


def test_surgery_without_toast_io_refuses_transformers_save(tmp_path):
    result = _child(_REPLACE_ONLY, tmp_path / "out", tmp_path=tmp_path, block_toast=False)
    assert "toast.save_pretrained(model, path)" in result["error"]
    assert result["written"] is False


def test_replace_spans_with_toast_io_saves_a_toast_save(tmp_path):
    model = H.build(next(f for f in H.FAMILIES if f.name == "bert"))
    toast.io.replace_spans(model, [(1, 3)], [torch.nn.Linear(H.HIDDEN, H.HIDDEN)])
    model.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "toast_plan.json").is_file()
