"""``toast.io.gguf``: a GGUF file is converted once; later loads read the
float32 copy in the cache, which holds exactly what the GGUF load gave."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from tests._helpers.digest import model_digest  # noqa: E402
from tests._helpers.tokenizers import char_tokenizer  # noqa: E402
from toast._scratch import hidden_sibling  # noqa: E402
from toast.io import gguf as gguf_io  # noqa: E402
from toast.io.local import load_model, load_tokenizer  # noqa: E402

pytestmark = pytest.mark.hf


def _tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=40, tie_word_embeddings=True,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A ``.gguf`` file whose reading is counted: a tiny Llama and a
    character tokenizer stand for transformers' GGUF reader."""
    monkeypatch.setenv("TOAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_io.CACHE_VARIABLE, raising=False)
    file = tmp_path / "models" / "tiny.gguf"
    file.parent.mkdir()
    file.write_bytes(b"GGUF")
    reads = {"model": 0, "tokenizer": 0}

    def read_model(path):
        reads["model"] += 1
        return _tiny_llama()

    def read_tokenizer(path):
        reads["tokenizer"] += 1
        return char_tokenizer("abcdefghij ")

    monkeypatch.setattr(gguf_io, "_read_model", read_model)
    monkeypatch.setattr(gguf_io, "_read_tokenizer", read_tokenizer)
    return file, reads


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_second_load_reads_the_cache_and_gives_the_same_model(fake):
    file, reads = fake
    first, second = load_model(file), load_model(file)
    assert reads == {"model": 1, "tokenizer": 1}  # the tokenizer is cached with the model
    assert _same(first, second) and not second.training
    assert second.name_or_path == str(file.parent)  # named where the file lies
    assert load_tokenizer(file)("abc").input_ids == char_tokenizer("abcdefghij ")("abc").input_ids
    assert reads == {"model": 1, "tokenizer": 1}


def test_a_changed_file_is_converted_again(fake):
    file, reads = fake
    load_model(file)
    file.write_bytes(b"GGUF, another version")
    load_model(file)
    assert reads["model"] == 2


def test_the_cache_can_be_turned_off(fake, monkeypatch):
    file, reads = fake
    monkeypatch.setenv(gguf_io.CACHE_VARIABLE, "0")
    load_model(file)
    load_model(file)
    assert reads["model"] == 2 and not gguf_io.entry_for(file).parent.exists()


def test_an_interrupted_write_leaves_nothing_and_is_never_read(fake, monkeypatch):
    file, reads = fake

    def stopped(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "save_pretrained", stopped)
    with pytest.raises(KeyboardInterrupt):
        load_model(file)
    assert list(gguf_io.entry_for(file).parent.iterdir()) == []
    monkeypatch.undo()  # the cache as the fixture set it, the tokenizer saving again
    monkeypatch.setenv("TOAST_CACHE", str(file.parent.parent / "cache"))
    monkeypatch.setattr(gguf_io, "_read_model", lambda path: _tiny_llama())
    monkeypatch.setattr(gguf_io, "_read_tokenizer", lambda path: char_tokenizer("ab"))
    load_model(file)
    assert (gguf_io.entry_for(file) / "model" / "config.json").is_file()


def test_an_unwritable_cache_warns_and_the_model_still_loads(fake, tmp_path, monkeypatch):
    file, _ = fake
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("TOAST_CACHE", str(blocked))
    with pytest.warns(RuntimeWarning, match="could not cache the float32 copy of tiny.gguf"):
        model = load_model(file)
    assert _same(model, _tiny_llama())


def test_a_killed_writes_folder_is_swept_and_a_live_ones_kept(fake):
    file, _ = fake
    root = gguf_io.entry_for(file).parent
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    name = gguf_io.entry_for(file).name
    dead = root / f".{name}.gguf-{int(exited.stdout)}-12345-0123abcd"
    live = hidden_sibling(gguf_io.entry_for(file), "gguf")  # this process's own
    dead.mkdir(parents=True)
    load_model(file)
    assert live.is_dir() and not dead.exists()
    assert gguf_io.is_cached(file)


def test_smollm2_from_the_cache_equals_the_gguf_load(smollm2_file, monkeypatch):
    file, read_digest = smollm2_file  # the session read the GGUF file once
    cached = load_model(file)
    assert (gguf_io.entry_for(file) / "model" / "config.json").is_file()
    assert cached.name_or_path == str(file.parent)
    assert model_digest(cached) == read_digest  # tensors, config, generation config
    text = "Depth pruning, déjà vu: <|im_start|>user\nHi!<|im_end|>"
    from_cache = load_tokenizer(file)
    monkeypatch.setenv(gguf_io.CACHE_VARIABLE, "0")
    from_file = load_tokenizer(file)
    assert from_cache(text).input_ids == from_file(text).input_ids
    assert from_cache.chat_template == from_file.chat_template
