"""Chat templates rendered as transformers renders them, and the assistant tokens of a conversation found from the
template's own spans.

Rendering (`ChatTemplate.render`) follows transformers' `apply_chat_template` (transformers/utils/
chat_template_utils.py): a sandboxed Jinja2 environment with trim_blocks and lstrip_blocks, the loop controls
(break/continue), a `tojson` that keeps non-ASCII text and takes indent/separators/sort_keys, `raise_exception`,
`strftime_now`, restricted `dict` and `namespace`, and a `{% generation %}` tag that renders its body (templates
written for transformers' assistant masks parse here too). The template sees `messages` (None-valued keys dropped),
`tools=None`, `documents=None`, `add_generation_prompt` and the tokenizer's special tokens as strings (`bos_token`,
`eos_token`, ...). The rendered text is tokenised with special-token text parsed as the special tokens, as
transformers' tokenizer(text) does (Tokenizer.encode_with_offsets).

Where the assistant's tokens are (`render_with_masks`) is read from renders, never searched for in the text: for the
i-th message, if it is the assistant's, messages[:i] rendered with the generation prompt must be a prefix of
messages[:i+1] rendered without it, and the assistant span is the difference (its trailing whitespace, which templates
write between turns, left out: the span ends with the turn's end token, as TRL's assistant_only_loss masks). The
spans must also survive in the whole conversation's render; a template that rewrites earlier turns breaks either
property and is refused in one line. A token is the assistant's when its character span overlaps an assistant span
(transformers' rule for return_assistant_tokens_mask).

Where the template comes from (`load_chat_template`): data.chat_template names a built-in (BUILTIN_TEMPLATES), a
.jinja file or a folder; empty, the tokenizer's own folder: chat_template.jinja, else tokenizer_config.json's
"chat_template" (transformers' order).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message. Tokenizers without these tokens encode them as text.
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Header tokens, for tokenizers that carry <|start_header_id|>, <|end_header_id|> and <|eot_id|> as special tokens
# (the tiktoken rank files' 256 specials): bos, then per message a role header, two newlines, content, <|eot_id|>.
HEADER = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# LLaVA-1.5's (Vicuna v1) layout: an optional system line, "USER: ... ASSISTANT: ..." turns, eos after each reply.
LLAVA = ("{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + ' ' }}"
         "{% elif message['role'] == 'assistant' %}{{ 'ASSISTANT: ' + message['content'] + eos_token }}"
         "{% else %}{{ 'USER: ' + message['content'] + ' ' }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")
BUILTIN_TEMPLATES = {"chatml": CHATML, "header": HEADER, "llava": LLAVA}
# transformers passes its special_tokens_map to the template: these names, where the tokenizer has them.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
KEY = "data.chat_template"


class ChatTemplateError(ValueError):
    """A template that cannot be found, compiled or used for masks; one line naming the template and the fix."""


class ConversationError(ChatTemplateError):
    """The template refuses one conversation (its raise_exception, a missing key): that record is bad, not the run."""


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
        # Earlier releases have sandbox escapes; templates from model folders are code from elsewhere.
        raise ChatTemplateError(f"chat templates need jinja2 >= 3.1.6 (found {jinja2.__version__}): "
                                "pip install -U jinja2")

    class Generation(Extension):
        """{% generation %}...{% endgeneration %}: transformers marks assistant text with it; rendered as its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the JSON text itself.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class SafeDict:
        """`dict(...)` inside a template builds a plain dict; nothing else of the type is reachable."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not store {name!r} on a namespace "
                                                  "(underscore names reach Python internals)")

    class SafeNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # Jinja's signature trick: namespace(self=...) still works
            obj, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _check(name)
            jinja2.utils.Namespace.__init__(obj, attrs)

        def __setitem__(self, name, value):
            _check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=SafeDict(), namespace=SafeNamespace)
    return env


@lru_cache(maxsize=32)
def compile_template(text: str):
    import jinja2

    try:
        return _environment().from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile (line {e.lineno}: {e.message}); fix it or set "
                                f"{KEY} to a built-in ({', '.join(BUILTIN_TEMPLATES)}) or a .jinja file") from None


def _plain(value: Any) -> Any:
    """JSON-like data only (as transformers hands templates): dicts, lists, strings, numbers, booleans, None."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    for base in (bool, str, int, float):  # subclasses (enums, numpy strings): their plain value
        if isinstance(value, base):
            return base(value)
    if callable(getattr(value, "item", None)):  # numpy / torch scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Any) -> list[dict]:
    """Plain dicts with their None-valued keys dropped (transformers drops them: templates test for a key, not for
    None). A ValueError naming what is wrong for anything that is not a list of messages with a role."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} objects, got "
                         f"{type(messages).__name__ if messages else 'an empty list'}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} is not an object with a string 'role' ({str(m)[:60]})")
        out.append({k: _plain(v) for k, v in m.items() if v is not None})
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A template, where it came from (for messages) and the special-token strings it sees."""

    text: str
    source: str = "the chat template"
    variables: dict = field(default_factory=dict)

    @cached_property
    def compiled(self):
        return compile_template(self.text)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text, exactly as transformers' apply_chat_template(tokenize=False) gives it."""
        import jinja2

        try:
            return self.compiled.render(messages=normalize_messages(messages) if messages else [], tools=None,
                                        documents=None, add_generation_prompt=add_generation_prompt,
                                        **self.variables)
        except (jinja2.exceptions.TemplateError, TypeError) as e:  # raise_exception(...), a missing key, None + str
            raise ConversationError(f"{self.source}: {e}") from None

    def assistant_spans(self, messages: list[dict], add_generation_prompt: bool = False
                        ) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, [start, end) of each assistant turn in it): see the module docstring."""
        text = self.render(messages, add_generation_prompt)
        spans = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not upto.startswith(before):
                raise ChatTemplateError(
                    f"{self.source}: the conversation up to message {i} with the generation prompt is not the start of "
                    f"the conversation with message {i} (the template changes earlier text when the assistant turn "
                    f"is added), so the assistant's tokens cannot be read from its renders; use a template whose "
                    f"turns only append ({KEY}=chatml, or a .jinja file)")
            end = max(len(before), len(upto.rstrip()))
            if not text.startswith(upto[:end]):
                raise ChatTemplateError(
                    f"{self.source}: assistant message {i} renders differently once later messages follow (the "
                    f"template rewrites earlier turns, e.g. drops their reasoning), so its tokens cannot be placed in "
                    f"the whole conversation; train on conversations that end at that turn, or use a template whose "
                    f"turns only append ({KEY}=chatml, or a .jinja file)")
            spans.append((len(before), end))
        return text, spans


def token_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose character span overlaps an assistant span (a token cut by a span's edge counts)."""
    import numpy as np

    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(off), dtype=bool)
    for a, b in spans:
        mask |= (off[:, 0] < b) & (off[:, 1] > a)
    return mask.astype(int).tolist()


def _as_template(template: ChatTemplate | str, tokenizer) -> ChatTemplate:
    if isinstance(template, ChatTemplate):
        return template
    return ChatTemplate(template, variables=special_token_variables(tokenizer, None))


def render_with_masks(template: ChatTemplate | str, messages: list[dict], tokenizer,
                      add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    """(token ids, assistant mask: 1 on each assistant token, the end-of-turn token included) of a conversation. A
    template string gets the tokenizer's bos/eos as its variables."""
    template = _as_template(template, tokenizer)
    text, spans = template.assistant_spans(messages, add_generation_prompt)
    ids, offsets = tokenizer.encode_with_offsets(text)
    return list(ids), token_mask(offsets, spans)


def end_of_turn(template: ChatTemplate | str, tokenizer=None) -> str:
    """The text a template writes after an assistant reply ("<|im_end|>", "<|eot_id|>", "</s>"): where generation of a
    reply stops. Empty when the template writes nothing there."""
    template = _as_template(template, tokenizer)
    marker = "\u2063reply\u2063"  # invisible separators: no template writes these itself
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
    text, spans = template.assistant_spans(convo)
    reply = text[spans[-1][0]:spans[-1][1]]
    return reply[reply.rfind(marker) + len(marker):] if marker in reply else ""


# ---------------------------------------------------------------------------------------------------- sources

def _token_text(value) -> str | None:
    """"<s>" or {"content": "<s>", ...} (tokenizer_config.json's two spellings) -> "<s>"."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _read_config(folder: Path | None) -> dict:
    path = folder / "tokenizer_config.json" if folder is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"{path}: not readable JSON ({e}); fix the file or set {KEY}") from None
    return cfg if isinstance(cfg, dict) else {}


def template_in_folder(folder: Path) -> tuple[str, str] | None:
    """(template, file) of an HF tokenizer folder: chat_template.jinja, else tokenizer_config.json's chat_template
    (a string, or transformers' list of {name, template} whose "default" is used); None when it has neither."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    value = _read_config(folder).get("chat_template")
    where = str(folder / "tokenizer_config.json")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" not in named:
            raise ChatTemplateError(f"{where}: its chat templates {sorted(map(str, named))} include no 'default'; "
                                    f"write the one to train with to a .jinja file and set {KEY} to it")
        value = named["default"]
    return (value, where) if isinstance(value, str) and value else None


def tokenizer_folder(tokenizer) -> Path | None:
    path = getattr(tokenizer, "path", None)
    if path is None:
        return None
    path = Path(path)
    return path if path.is_dir() else path.parent


def special_token_variables(tokenizer, folder: Path | None) -> dict:
    """The special-token strings a template sees: tokenizer_config.json's entries in the tokenizer's folder (what
    transformers' special_tokens_map holds, an explicit null included), else the tokenizer's own bos/eos."""
    cfg = _read_config(folder)
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        if name in cfg:
            if (text := _token_text(cfg[name])):
                out[name] = text
        elif name in ("bos_token", "eos_token") and tokenizer is not None:
            out[name] = tokenizer.decode([getattr(tokenizer, name.replace("_token", "_id"))])
    return out


def load_chat_template(data_cfg, tokenizer, key: str = KEY) -> ChatTemplate:
    """The run's template (see the module docstring); a ChatTemplateError naming `key` and the fix if there is none."""
    spec = getattr(data_cfg, "chat_template", "") or ""
    folder = tokenizer_folder(tokenizer)
    builtins = ", ".join(f"'{n}'" for n in BUILTIN_TEMPLATES)
    if spec in BUILTIN_TEMPLATES:
        found = (BUILTIN_TEMPLATES[spec], f"the built-in {spec!r} template")
    elif spec:
        path = Path(spec).expanduser()
        if path.is_file():
            found = (path.read_text(encoding="utf-8"), str(path))
        elif path.is_dir():
            found = template_in_folder(path)
            if found is None:
                raise ChatTemplateError(f"{key}={spec!r}: the folder holds no chat_template.jinja and no "
                                        f"tokenizer_config.json with a chat_template; name a built-in ({builtins}) "
                                        f"or a .jinja file")
        else:
            raise ChatTemplateError(f"{key}={spec!r} is neither a built-in template ({builtins}) nor an existing "
                                    f".jinja file or tokenizer folder")
    else:
        found = template_in_folder(folder) if folder is not None else None
        if found is None:
            where = f"its folder {folder}" if folder is not None else "it"
            raise ChatTemplateError(f"{key} is empty and the tokenizer ({type(tokenizer).__name__}) has no chat "
                                    f"template in {where} (chat_template.jinja or tokenizer_config.json): set {key} "
                                    f"to a built-in ({builtins}), a .jinja file, or an HF tokenizer folder")
    template = ChatTemplate(found[0], found[1], special_token_variables(tokenizer, folder))
    template.compiled  # noqa: B018 - a template that does not compile fails here, at start-up
    return template
