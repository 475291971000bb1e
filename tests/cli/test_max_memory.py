"""``--max-memory`` holds as a user meets it: ``toast compress`` on a bf16
checkpoint larger than its budget, anonymous resident memory polled from
outside, at the ratio of ``benchmarks/bench_max_memory.py`` (1 GiB for
1.72 GiB of safetensors there, 52 MiB for 87 MiB here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests._helpers import peak_anon_mib

from .conftest import TEXTS, _tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

BUDGET_MIB = 52


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random bf16 Llama of 46 M parameters (12 blocks 512 wide: 16.5 MiB
    a block in float32) in 19 MB shards, with calibration text (about
    1,000 calibration rows: the memory plan has no term per token, so more
    text would only lengthen the passes)."""
    root = tmp_path_factory.mktemp("bf16_llama")
    tokenizer = _tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=2048,
        num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(root / "model", max_shard_size="19MB")
    tokenizer.save_pretrained(root / "model")
    (root / "calib.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    return root


def _compress(
    root: Path, budget: str, out: str, method: str = "replaceme"
) -> tuple[int, float, str]:
    toast_cli = str(Path(sys.executable).with_name("toast"))
    return peak_anon_mib([
        toast_cli, "compress", str(root / "model"), "--method", method,
        "--data", str(root / "calib.txt"), "--num-blocks", "2",
        "--out", str(root / out), "--max-memory", budget,
    ])  # fmt: skip


def test_compress_peaks_within_the_budget_above_the_interpreter(checkpoint):
    # the interpreter with its libraries: the same command refused at its plan
    code, interpreter, said = _compress(checkpoint, "16MiB", "refused")
    assert code == 2 and "needs at least" in said
    code, peak, said = _compress(checkpoint, f"{BUDGET_MIB}MiB", "out")
    assert code == 0, said[-2000:]
    assert "sequential path" in said and "memory plan:" in said
    assert peak - interpreter <= BUDGET_MIB, (peak, interpreter)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint / "out")
    assert reloaded.config.num_hidden_layers == 10 and reloaded.dtype == torch.bfloat16
    logits = reloaded(input_ids=torch.tensor([[1, 5, 9, 12]])).logits
    assert torch.isfinite(logits).all()


def test_toast_with_its_moments_chunked_from_disk_peaks_within_the_budget(checkpoint):
    # 320 MiB leaves too little for the 13 states' whole moments (0.35 GiB):
    # they are chunked, replayed from disk in reads the plan counts
    code, interpreter, said = _compress(checkpoint, "16MiB", "refused-toast", "toast")
    assert code == 2 and "needs at least" in said
    code, peak, said = _compress(checkpoint, "320MiB", "out-toast", "toast")
    assert code == 0, said[-2000:]
    assert "moments, chunked from disk" in said
    assert peak - interpreter <= 320, (peak, interpreter)
    # a translator is the saved model's own code: plain transformers runs it when trusted
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint / "out-toast", trust_remote_code=True
    )
    assert torch.isfinite(reloaded(input_ids=torch.tensor([[1, 5, 9, 12]])).logits).all()
