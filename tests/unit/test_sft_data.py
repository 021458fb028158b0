"""Chat templates (titanlike/data/chat.py) against transformers: templates render and tokenise exactly as
`apply_chat_template` does (Llama-3-, Qwen/ChatML- and Mistral-style templates, tests/unit/chat_fixtures.py, on tiny
byte-level BPE tokenizer folders built offline); the assistant masks equal transformers' `return_assistant_tokens_mask`
on templates with {% generation %} tags; where templates come from, and templates that rewrite turns refused in one
line. (Chat data as a dataset: tests/unit/test_sft_dataset.py; training, export and generate --chat:
tests/unit/test_sft_train.py.)"""
from __future__ import annotations


import pytest
import torch

from titanlike.data.chat import ChatTemplateError, render_with_masks

from chat_fixtures import (  # tests/unit/chat_fixtures.py
    CHATML_GEN, TEMPLATES, CONVERSATIONS, make_folder, ours, _convos, write_file, folder_maker, train_tokenizer_json)

transformers = pytest.importorskip("transformers")
torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    return train_tokenizer_json(tmp_path_factory)


@pytest.fixture
def folder(tmp_path, tokenizer_json):
    return folder_maker(tmp_path, tokenizer_json)


# ------------------------------------------------------------------------------------------ rendering = transformers

@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_render_and_tokens_equal_transformers(folder, name):
    path = folder(name)
    tok, template = ours(path)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    for convo in _convos(name):
        for cut, gen in ((len(convo), False), (len(convo) - 1, True)):  # whole, and up to the last reply + prompt
            msgs = convo[:cut]
            text = template.render(msgs, add_generation_prompt=gen)
            assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            ids, _ = render_with_masks(template, msgs, tok, add_generation_prompt=gen)
            assert ids == hf.apply_chat_template(msgs, add_generation_prompt=gen, return_dict=True)["input_ids"]
            assert len(ids) > 10


@pytest.mark.parametrize("builtin", ["chatml", "header"])
def test_builtin_templates_equal_transformers(folder, builtin):
    from titanlike.data.chat import BUILTIN_TEMPLATES

    path = folder("llama3_gen")  # a folder whose tokenizer has both built-ins' special tokens
    tok, template = ours(path, chat_template=builtin)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    for convo in CONVERSATIONS:
        kw = dict(chat_template=BUILTIN_TEMPLATES[builtin], add_generation_prompt=True)
        assert template.render(convo[:-1], True) == hf.apply_chat_template(convo[:-1], tokenize=False, **kw)
        ids, mask = render_with_masks(template, convo, tok)
        assert ids == hf.apply_chat_template(convo, return_dict=True, chat_template=kw["chat_template"])["input_ids"]
        assert tok.decode([t for t, m in zip(ids, mask) if m]).count({"chatml": "<|im_end|>",
                                                                      "header": "<|eot_id|>"}[builtin]) == \
            sum(m["role"] == "assistant" for m in convo)


@pytest.mark.parametrize("name", ["chatml_gen", "llama3_gen"])
def test_masks_equal_transformers_generation_tags(folder, name):
    """transformers marks the {% generation %} spans; ours come from renders of the prefixes, without the tags."""
    path = folder(name)
    tok, template = ours(path)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    for convo in CONVERSATIONS:
        ids, mask = render_with_masks(template, convo, tok)
        out = hf.apply_chat_template(convo, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == out["input_ids"] and mask == out["assistant_masks"] and sum(mask) > 0


@pytest.mark.parametrize("name", ["llama3", "qwen", "mistral"])
def test_masks_cover_replies_and_their_end_token_only(folder, name):
    """The supervised tokens decode to exactly each reply (as the template writes it) followed by its end-of-turn
    token: nothing of a system or user turn, nothing of the headers."""
    _, _, eot = TEMPLATES[name]
    tok, template = ours(folder(name))
    for convo in _convos(name):
        ids, mask = render_with_masks(template, convo, tok)
        replies = [m["content"] for m in convo if m["role"] == "assistant"]
        written = {"llama3": lambda r: r.strip(), "qwen": lambda r: r, "mistral": lambda r: " " + r}[name]
        runs, run = [], []
        for t, m in zip(ids, mask):
            if m:
                run.append(t)
            elif run:
                runs, run = runs + [run], []
        runs += [run] if run else []
        assert [tok.decode(r) for r in runs] == [written(r) + eot for r in replies]


def test_templates_that_rewrite_turns_are_refused_in_one_line(tmp_path, tokenizer_json):
    other_header = CHATML_GEN.replace("'<|im_start|>' + message['role']", "'<|im_start|>' + ('bot' if "
                                      "message['role'] == 'assistant' else message['role'])")
    drops_earlier = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m['role'] == 'assistant' "
                     "and not loop.last %}{{ '...' }}{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\\n' }}"
                     "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    for i, (template, says) in enumerate(((other_header, "is not the start of"),
                                          (drops_earlier, "renders differently once later messages follow"))):
        tok, t = ours(make_folder(tmp_path / str(i), tokenizer_json, template, None, "<|end_of_text|>"))
        with pytest.raises(ChatTemplateError, match=says) as e:
            render_with_masks(t, CONVERSATIONS[1], tok)
        assert "\n" not in str(e.value) and "data.chat_template" in str(e.value)


def test_where_the_template_comes_from(tmp_path, tokenizer_json):
    path = make_folder(tmp_path / "f", tokenizer_json, "config {{ messages[0].content }}", None, "<|end_of_text|>")
    msgs = [{"role": "user", "content": "x"}]
    assert ours(path)[1].render(msgs) == "config x"
    (path / "chat_template.jinja").write_text("jinja {{ messages[0].content }}")  # transformers prefers the file
    assert ours(path)[1].render(msgs) == "jinja x"
    assert ours(path, chat_template="chatml")[1].render(msgs) == "<|im_start|>user\nx<|im_end|>\n"
    (tmp_path / "t.jinja").write_text("file {{ eos_token }}")
    assert ours(path, chat_template=str(tmp_path / "t.jinja"))[1].render(msgs) == "file <|end_of_text|>"
    listed = make_folder(tmp_path / "l", tokenizer_json, [{"name": "default", "template": "d"},
                                                          {"name": "tool_use", "template": "t"}], None, "</s>")
    assert ours(listed)[1].render(msgs) == "d"
    bare = make_folder(tmp_path / "b", tokenizer_json, None, None, "</s>")
    for kw, says in (({}, "data.chat_template is empty and the tokenizer"),
                     ({"chat_template": "nope"}, "neither a built-in template"),
                     ({"chat_template": str(tmp_path / "t.jinja") + "x"}, "neither a built-in template")):
        with pytest.raises(ChatTemplateError, match=says) as e:
            ours(bare, **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ours(bare, chat_template=str(write_file(tmp_path / "bad.jinja", "{% for %}")))
