"""What the chat-data tests share (tests/unit/test_sft_data.py, test_sft_dataset.py): chat templates in the layouts of
Llama 3, Qwen/ChatML and Mistral written here, conversations, and tiny byte-level BPE tokenizer folders built offline
(`train_tokenizer_json`, `make_folder`; each test module wraps them as its fixtures)."""
from __future__ import annotations

import json

from titanlike.config.sections import Data
from titanlike.data.chat import load_chat_template
from titanlike.data.tokenizers import build_tokenizer

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
CORPUS = ["the quick brown fox jumps over the lazy dog", "what is two plus two? it is four.",
          "you are a helpful assistant", "hello, how are you today? I am fine, thanks!", "def f(x): return x * 2"]

# Meta's Llama 3.1 layout: the date from strftime_now, a system turn always, trimmed content, <|eot_id|> ends a turn.
LLAMA3 = """{{- bos_token }}
{%- if strftime_now is defined %}{%- set date_string = strftime_now("%d %b %Y") %}
{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}
{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim
        + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
# Qwen2.5's layout: a default system turn, namespace, loop controls, tojson (non-ASCII and markup kept as they are).
QWEN = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\n' + ({"persona": "helpful", "note": "é & <b>"} | tojson) + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role == "system" and loop.first %}{%- continue %}{%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
# Mistral's [INST] layout: roles must alternate (raise_exception), eos after each reply, no generation prompt.
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
           "{% endfor %}")
# The same layouts with transformers' {% generation %} tags around what the assistant writes.
CHATML_GEN = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
              "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
              "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_GEN = ("{{ bos_token }}{% for message in messages %}"
              "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
              "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
              "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
TEMPLATES = {"llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"), "qwen": (QWEN, None, "<|im_end|>"),
             "mistral": (MISTRAL, "<s>", "</s>"), "chatml_gen": (CHATML_GEN, None, "<|end_of_text|>"),
             "llama3_gen": (LLAMA3_GEN, "<|begin_of_text|>", "<|end_of_text|>")}

CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "it is four."}],
    [{"role": "system", "content": "You are a helpful  assistant.\n"}, {"role": "user", "content": "Hello 東京 🚀"},
     {"role": "assistant", "content": "  hi there,\nhow are you?"}, {"role": "user", "content": "fine, thanks!"},
     {"role": "assistant", "content": "def f(x): return x * 2"}],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "why?"},
     {"role": "assistant", "content": "because. ünïcödé"}],
]


def train_tokenizer_json(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path.read_text()


def make_folder(path, tokenizer_json: str, template: str | None, bos: str | None, eos: str, **config):
    """An HF tokenizer folder: tokenizer.json + tokenizer_config.json (class, special tokens, chat_template)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json)
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, **config}
    if template is not None:
        cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def folder_maker(tmp_path, tokenizer_json):
    def make(name: str, **config):
        template, bos, eos = TEMPLATES[name]
        return make_folder(tmp_path / name, tokenizer_json, template, bos, eos, **config)
    return make


def ours(path, **data):
    cfg = Data(tokenizer=str(path), **data)
    tok = build_tokenizer(cfg)
    return tok, load_chat_template(cfg, tok)


def _convos(name: str) -> list[list[dict]]:
    if name == "mistral":  # no system turn (the template refuses it)
        return [c[1:] if c[0]["role"] == "system" else c for c in CONVERSATIONS]
    return CONVERSATIONS


def write_file(path, text):
    path.write_text(text)
    return path
