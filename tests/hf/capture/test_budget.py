"""The memory plan's batch-dependent parts: one block's forward and the
held-out logits, read from the batches' shapes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests._helpers import run_fresh  # noqa: E402
from toast.hf.capture.budget import batch_shape, logit_rows  # noqa: E402

pytestmark = pytest.mark.hf

_FORWARD = """
import sys, gc, torch, transformers
from toast.hf.capture.budget import forward_bytes
rows, tokens = int(sys.argv[1]), int(sys.argv[2])
cfg = transformers.LlamaConfig(
    hidden_size=256, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
    num_hidden_layers=1, vocab_size=64,
)
torch.manual_seed(0)
model = transformers.LlamaModel(cfg).eval()
ids = torch.randint(0, 64, (rows, tokens))
mask = torch.ones(rows, tokens, dtype=torch.long)
mask[0, : tokens // 2] = 0  # padding: the attention cannot take its fused path
with torch.no_grad():
    states = model.embed_tokens(ids)
    model(input_ids=ids[:1, :8])  # the allocator's first growth is not the forward's
    gc.collect()
    before = rss_mib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    model(inputs_embeds=states, attention_mask=mask)
    used = peak_mib() - before
print(json.dumps({"used": used, "planned": forward_bytes(cfg, rows, tokens) / 2**20}))
"""


@pytest.mark.parametrize(("rows", "tokens"), [(8, 256), (1, 1024)])
def test_a_blocks_forward_allocates_no_more_than_the_plan_says(rows, tokens):
    found = run_fresh(_FORWARD, rows, tokens)
    assert 0 < found["used"] <= found["planned"]


def test_the_batch_shape_is_the_most_rows_and_tokens_of_any_batch():
    batches = [
        {"input_ids": torch.zeros(8, 20, dtype=torch.long)},
        {"input_ids": torch.zeros(3, 64, dtype=torch.long)},
    ]
    assert batch_shape(batches, transformers.LlamaConfig()) == (8, 64)


def test_an_images_tokens_are_its_patches_and_the_class_token():
    config = transformers.ViTConfig(patch_size=16)
    assert batch_shape([{"pixel_values": torch.zeros(4, 3, 224, 224)}], config) == (4, 197)


def test_batches_without_shapes_give_no_batch_part():
    assert batch_shape([[1, 2, 3]], transformers.LlamaConfig()) is None


def test_logits_go_a_run_of_rows_within_the_bound_and_at_least_a_row():
    from toast.hf.capture.budget import LOGIT_BYTES

    vocabulary = 49_152
    per = logit_rows(64, 128, vocabulary)
    assert per * 128 * vocabulary * 4 <= LOGIT_BYTES < (per + 1) * 128 * vocabulary * 4
    assert logit_rows(64, 8192, vocabulary) == 1  # one row alone is more than the bound
    assert logit_rows(4, 16, 60) == 4  # a small vocabulary: the whole batch


def test_a_row_over_the_logit_bound_is_planned_as_runs_of_positions_and_its_states():
    from toast.hf.capture.budget import LOGIT_BYTES, logit_bytes

    vocabulary, width, tokens = 49_152, 2_048, 1_024
    run = LOGIT_BYTES // (vocabulary * 4)
    planned = logit_bytes(8, tokens, vocabulary, width)
    assert planned == 3 * run * vocabulary * 4 + tokens * width * 4
    assert planned < 3 * tokens * vocabulary * 4 / 2  # a row's logits whole: twice as much or more
    assert (
        logit_bytes(8, 16, vocabulary, width)
        == 3 * logit_rows(8, 16, vocabulary) * 16 * vocabulary * 4
    )


_EVALUATOR = """
import sys, gc, torch, transformers
from toast.hf.capture.budget import in_memory_parts
from toast.hf.evaluate.quality import Evaluator
rows, tokens = int(sys.argv[1]), int(sys.argv[2])
cfg = transformers.LlamaConfig(
    hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=2, vocab_size=16384, architectures=["LlamaForCausalLM"],
)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 16384, (rows, tokens))
batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
first = {"input_ids": ids[:1, :8], "attention_mask": torch.ones_like(ids[:1, :8])}
Evaluator([first], progress=False).measure(model)  # the allocator's first growth
evaluator, used = Evaluator([batch], progress=False), []
for label in ("original", "compressed"):  # the reference's pass keeps its top-k too
    gc.collect()
    before = rss_mib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    evaluator.measure(model, label)
    used.append(peak_mib() - before)
planned = sum(n for _, n in in_memory_parts(cfg, (rows, tokens))) / 2**20
print(json.dumps({"used": used, "planned": planned}))
"""


def test_a_loaded_models_held_out_pass_allocates_no_more_than_its_run_parts():
    found = run_fresh(_EVALUATOR, 8, 256)
    assert all(0 < used <= found["planned"] for used in found["used"]), found


def test_a_loaded_run_holds_its_statistics_a_forward_and_three_batches_of_logits():
    from toast.hf.capture.budget import FORWARD_LABEL, forward_bytes, in_memory_parts

    llm = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=256, num_attention_heads=4, num_hidden_layers=2,
        vocab_size=1000, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    parts = in_memory_parts(llm, (3, 20), [("moments", 123)])
    assert parts == [
        ("moments", 123),
        (FORWARD_LABEL, forward_bytes(llm, 3, 20)),
        ("held-out logits", 3 * 3 * 20 * 1000 * 4),
    ]
    vit = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    assert in_memory_parts(vit, (3, 20)) == [(FORWARD_LABEL, forward_bytes(vit, 3, 20))]
    assert in_memory_parts(llm, None, [("moments", 123)]) == [("moments", 123)]


def test_the_batches_shape_is_read_once_for_the_path_and_the_plan():
    from toast.hf.capture.budget import ShapeOnce

    reads = []
    batch = {"input_ids": torch.zeros(3, 7, dtype=torch.long)}
    shape = ShapeOnce(lambda: reads.append(True) or [batch])
    assert shape(None) == (3, 7) and shape(None) == (3, 7) and reads == [True]
    nothing = ShapeOnce(lambda: reads.append(True) or [])
    assert nothing(None) is None and nothing(None) is None and reads == [True, True]
