"""ReplaceMe writes standard checkpoints: ``model.save_pretrained`` output
loads with ``AutoModelForCausalLM.from_pretrained`` in a fresh interpreter
that never imports toast, with n fewer layers, no extra or missing
parameters, the same logits, and a working KV-cache ``generate``."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._helpers import replaceme_models as R  # noqa: E402
from toast.methods.replaceme import replaceme  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

FAMILIES = ["llama", "mistral", "qwen2", "phi3", "gemma", "gpt2", "opt"]

_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    root, names = sys.argv[1], sys.argv[2].split(",")
    result = {}
    for name in names:
        folder = f"{root}/{name}"
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        model.eval()
        batch = {k: torch.from_numpy(v) for k, v in np.load(f"{folder}/batch.npz").items()}
        with torch.no_grad():
            logits = model(**batch, use_cache=False).logits.numpy()
        expected = np.load(f"{folder}/logits.npy")
        prompt = {k: v[:2, :4] for k, v in batch.items()}
        kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        cached = model.generate(**prompt, use_cache=True, **kw)
        uncached = model.generate(**prompt, use_cache=False, **kw)
        result[name] = {
            "layers": model.config.num_hidden_layers,
            "params": sum(p.numel() for p in model.parameters()),
            "loading": {k: sorted(map(str, v)) for k, v in info.items()},
            "rel_err": float(np.linalg.norm(logits - expected) / np.linalg.norm(expected)),
            "generate_equal": bool(torch.equal(cached, uncached)),
            "generated": int(cached.shape[1]),
        }
    result["toast_imported"] = any(m == "toast" or m.startswith("toast.") for m in sys.modules)
    print(json.dumps(result))
    """
)


def test_saved_checkpoints_reload_in_a_fresh_process_without_toast(tmp_path):
    loader = R.text_loader()
    batch = loader[0]
    expected = {}
    for name in FAMILIES:
        # folded: a standard checkpoint (the block placement saves with toast.save_pretrained)
        options = {"num_blocks": 2, "placement": "fold", "progress": False}
        model, report = replaceme(R.decoder(name), loader, **options)
        folder = tmp_path / name
        model.save_pretrained(folder)
        np.savez(folder / "batch.npz", **{k: v.numpy() for k, v in batch.items()})
        np.save(folder / "logits.npy", R.outputs(model, batch).numpy())
        expected[name] = report
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path), ",".join(FAMILIES)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result.pop("toast_imported") is False
    for name, got in result.items():
        report = expected[name]
        assert got["layers"] == R.LAYERS - 2, name
        assert got["params"] == report.params_after < report.params_before, name
        assert all(not v for v in got["loading"].values()), (name, got["loading"])
        assert got["rel_err"] <= 1e-6, (name, got["rel_err"])
        assert got["generate_equal"] and got["generated"] == 4 + 6, name
