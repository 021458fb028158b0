"""Image conversations through a chat template (data.wds_target = "json" with a real tokenizer,
titanlike/data/webdataset_rows.py): the row's tokens equal transformers' apply_chat_template with `<image>` a special
token expanded to the placeholder run, and the targets are exactly the answers (and their end-of-turn tokens): on the
tokenizer folder's own template (against transformers' assistant mask) and on the built-in LLaVA-1.5 default."""
from __future__ import annotations

import dataclasses
import json
import tarfile

import pytest
import torch

from models.batch import IGNORE_INDEX
from titanlike.config.errors import ConfigError
from titanlike.config.sections import Data
from titanlike.data.chat import LLAVA
from titanlike.data.image_text import PIXELS
from titanlike.data.tokenizers import build_tokenizer

from chat_fixtures import CHATML_GEN, make_folder, train_tokenizer_json  # tests/unit/chat_fixtures.py

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")
from titanlike.data.dataset import build_dataset  # noqa: E402
from titanlike.data.webdataset_write import write_shapes_shards  # noqa: E402

torch.set_num_threads(1)
VOCAB, RUN = 512, 16
SEQ = 2 * PIXELS + 256  # two slots: the shards' two-image conversations (162 tokens with ChatML)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("wds_chat")
    tok_json = train_tokenizer_json(tmp_path_factory)
    own = make_folder(root / "own", tok_json, CHATML_GEN, None, "<|end_of_text|>")
    plain = make_folder(root / "plain", tok_json, None, "<s>", "</s>")
    return write_shapes_shards(root / "shards", 4, 4, images_per_sample=2), own, plain


def rows(shards, folder, **kw):
    data = dataclasses.replace(Data(), dataset="webdataset", paths=[str(p) for p in shards], image_size=32,
                               image_tokens=RUN, images_per_row=2, wds_target="json", tokenizer=str(folder), **kw)
    return build_dataset(data, build_tokenizer(data), seq_len=SEQ, vocab_size=VOCAB)


def messages(shard: str, i: int) -> list[dict]:
    with tarfile.open(shard) as tar:
        turns = json.loads(tar.extractfile(f"{i:06d}.json").read())
    return [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]} for t in turns]


def hf_row(folder, convo, **kw) -> tuple[list[int], list[int]]:
    """transformers' ids and assistant mask with <image> a special token, each expanded to the placeholder run."""
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    hf.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image = hf.convert_tokens_to_ids("<image>")
    out = hf.apply_chat_template(convo, return_dict=True, return_assistant_tokens_mask=True, **kw)
    ids, mask = [], []
    for t, m in zip(out["input_ids"], out["assistant_masks"]):
        ids += [VOCAB - 1] * RUN if t == image else [t]
        mask += [0] * RUN if t == image else [m]
    return ids, mask


def text_and_targets(ds, i):
    ids, labels = ds[i]
    assert ids[:2 * PIXELS].any(dim=-1) and ids[PIXELS:2 * PIXELS].any()  # both slots hold their image
    text = ids[2 * PIXELS:].tolist()
    n = next(p for p in range(len(text), 0, -1) if text[p - 1])  # (no conversation ends in id 0)
    return text[:n], labels[2 * PIXELS:2 * PIXELS + n].tolist()


def test_folder_template_equals_transformers_and_trains_on_answers_only(setup):
    shards, own, _ = setup
    ds = rows(shards, own)
    for i in range(4):
        text, targets = text_and_targets(ds, i)
        want, mask = hf_row(own, messages(shards[0], i))  # the template's {% generation %} spans: the answers
        assert text == want and sum(mask) > 0 and (torch.tensor(text) == VOCAB - 1).sum() == 2 * RUN
        # position p's target is token p + 1 where that token is the assistant's; nothing else is a target
        assert targets == [t if m else IGNORE_INDEX for t, m in zip(text[1:] + [0], mask[1:] + [0])]


def test_default_is_llava_1_5s_layout_with_loss_on_each_answer(setup):
    shards, _, plain = setup
    ds = rows(shards, plain)  # the folder has no template: the built-in "llava"
    tok = build_tokenizer(dataclasses.replace(Data(), tokenizer=str(plain)))
    for i in range(4):
        convo = messages(shards[0], i)
        text, targets = text_and_targets(ds, i)
        want, _ = hf_row(plain, convo, chat_template=LLAVA)
        assert text == want
        assert tok.decode([t for t in text if t != VOCAB - 1]).startswith("USER: \nwhat is it ASSISTANT: ")
        trained = [t for t in targets if t != IGNORE_INDEX]
        answers = [m["content"] for m in convo if m["role"] == "assistant"]
        assert tok.decode(trained) == "".join(f" {a}</s>" for a in answers)
    # an explicit data.chat_template wins over the default; a tokenizer folder without one and no such file: refused
    assert rows(shards, plain, chat_template="chatml")[0][0][2 * PIXELS:].tolist() != ds[0][0][2 * PIXELS:].tolist()
    with pytest.raises(ConfigError, match=r"data.wds_target='json': data.chat_template='nope.jinja' is neither"):
        rows(shards, plain, chat_template="nope.jinja")
