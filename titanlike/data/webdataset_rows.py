"""The rows of WebDataset samples (titanlike/data/webdataset.py reads the shards; this makes their loader rows).

- ClassRows ("cls"): ViT rows as titanlike/data/images.py: one image's bytes, every label its class.
- TextRows ("txt" / "json"): LLaVA rows as models/llava/objective.py reads them: data.images_per_row slots of pixel
  bytes (a sample's k-th image fills slot k; slots past its images stay zero, which the objective ignores), then the
  text, with one run of data.image_tokens placeholders (the vocabulary's last id) per image. A caption puts every
  image's run first, then the caption (trained on, with its end token); a conversation puts image k's run where its
  k-th `<image>` marker stands (LLaVA's and energon's convention: one marker per image, in order), loss on the
  assistant's turns and their end tokens only. With a real tokenizer a conversation is rendered through a chat
  template (conversation_template: data.chat_template, the tokenizer folder's, else the built-in "llava") and the
  trained tokens are the template's assistant spans (titanlike/data/chat.py, as SFT data); with NullTokenizer (the
  shapes shards' word ids) its turns are encoded one by one, each answer followed by the end word. A conversation
  whose marker count differs from its images is a bad sample (BadImage: data.bad_samples decides), since the pairing
  of runs with slots would be a guess.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

from models.batch import IGNORE_INDEX
from titanlike.config.errors import ConfigError
from titanlike.data.images import CHANNELS, BadImage, image_side

ASSISTANT_ROLES = ("gpt", "assistant")  # LLaVA's conversations say "gpt", chat data "assistant"
ROLES = {"human": "user", "gpt": "assistant"}  # LLaVA's roles as chat templates name them
MARKER = "<image>"


def conversation_template(data_cfg, tokenizer):
    """The chat template conversations render through: data.chat_template if set, else the tokenizer folder's own
    (chat_template.jinja / tokenizer_config.json), else the built-in "llava" (LLaVA-1.5's "USER: ... ASSISTANT:
    ..."). A tokenizer must tell where each token lies in the text (HF tokenizer.json, tiktoken)."""
    from types import SimpleNamespace

    from titanlike.data.chat import load_chat_template, template_in_folder, tokenizer_folder

    spec = data_cfg.chat_template
    if not spec:
        folder = tokenizer_folder(tokenizer)
        spec = "" if folder is not None and template_in_folder(folder) is not None else "llava"
    try:
        tokenizer.encode_with_offsets("a")
        return load_chat_template(SimpleNamespace(chat_template=spec), tokenizer)
    except ValueError as e:  # ChatTemplateError, or a tokenizer without offsets: one line naming the key
        raise ConfigError(f"data.wds_target='json': {e}") from None


class ClassRows:
    """.cls members -> ViT rows: the image's bytes, every label the class."""

    images_per_row = 1  # a ViT row is one image

    def __init__(self, seq_len: int):
        self.side = image_side(seq_len, "webdataset")
        self.layout = f"{self.side}x{self.side} images, one class each"

    def __call__(self, images: list[np.ndarray], raw: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            label = int(raw.decode("utf-8").strip())
        except (UnicodeDecodeError, ValueError):
            raise BadImage(f"not a class id ({raw[:20]!r}; a .cls member holds one integer)") from None
        if label < 0:
            raise BadImage(f"class {label} is negative")
        ids = torch.from_numpy(images[0].astype(np.int64).reshape(-1))
        return ids, torch.full_like(ids, label)


class TextRows:
    """.txt captions / .json conversations -> LLaVA rows (image slots, then text with placeholder runs)."""

    def __init__(self, seq_len: int, side: int, image_tokens: int, vocab_size: int, tokenizer, messages_key: str,
                 images_per_row: int = 1, template=None):
        self.template = template  # conversations: a chat template (titanlike/data/chat.py), or turns one by one
        self.seq_len, self.side, self.image_tokens = seq_len, side, image_tokens
        self.images_per_row = images_per_row
        self.pixels = CHANNELS * side * side
        self.head = images_per_row * self.pixels
        self.image_token = vocab_size - 1
        self.messages_key = messages_key
        need = self.head + images_per_row * image_tokens + 2
        if seq_len < need:
            raise ConfigError(f"training.seq_len={seq_len}: a webdataset row holds {images_per_row} slot(s) of "
                              f"{self.pixels} pixel values (data.image_size={side}, data.images_per_row="
                              f"{images_per_row}), {image_tokens} image tokens per image and the text; set "
                              f"training.seq_len >= {need} (plus the text's length)")
        if tokenizer is None or type(tokenizer).__name__ == "NullTokenizer":  # the shapes shards' word ids
            from titanlike.data.image_text import WORD_ID

            if vocab_size < len(WORD_ID) + 2:
                raise ConfigError(f"model.vocab_size={vocab_size}: the word ids of image_text.py need "
                                  f"{len(WORD_ID) + 2} (words, padding, the image token)")
            self.words, self.end = WORD_ID, WORD_ID["<end>"]
        else:
            if tokenizer.vocab_size > self.image_token:
                raise ConfigError(f"model.vocab_size={vocab_size}: the image token is the vocabulary's last id, "
                                  f"which the tokenizer ({tokenizer.vocab_size} ids) uses; set model.vocab_size >= "
                                  f"{tokenizer.vocab_size + 1}")
            self.words, self.end = None, tokenizer.eos_id
        self.tokenizer = tokenizer
        # (the layout is in the data fingerprint a checkpoint checks: one slot keeps the words it had before)
        slots = f"{side}x{side} images" if images_per_row == 1 else f"{images_per_row} slots of {side}x{side} images"
        self.layout = (f"{slots} + {image_tokens} image tokens, text to {seq_len - self.head} tokens (longer text is "
                       "cut)")
        if template is not None:  # (by its text: the same template read from another folder is the same rows)
            self.layout += f", chat template {hashlib.sha256(template.text.encode()).hexdigest()[:8]}"

    def encode(self, text: str) -> list[int]:
        if not text.strip():
            return []
        if self.words is None:
            return self.tokenizer.encode(text.strip())
        unknown = [w for w in text.split() if w not in self.words]
        if unknown:
            raise BadImage(f"words {unknown[:3]} are not in image_text.py's word list (NullTokenizer); set "
                           "data.tokenizer / data.tokenizer_type to a real tokenizer for real captions")
        return [self.words[w] for w in text.split()]

    def _with_runs(self, text: str) -> list[int]:
        """text's ids with a placeholder run where each <image> marker stands (pieces encoded one by one, as
        LLaVA's tokenizer_image_token does: a marker never merges with its neighbours)."""
        pieces = text.split(MARKER)
        out = self.encode(pieces[0])
        for piece in pieces[1:]:
            out += [self.image_token] * self.image_tokens + self.encode(piece)
        return out

    def turns(self, raw: bytes, images: int) -> list[tuple[list[int], bool | list[bool]]]:
        """[(ids, trained)]: a caption is its images' runs then one trained turn; a conversation's assistant turns
        are the trained ones (placeholders are never targets: the objective ignores them). Through a chat template
        the conversation is one rendered piece whose `trained` is per token."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise BadImage("not UTF-8 text") from None
        if not text.lstrip().startswith(("[", "{")):  # a .txt caption: images first, markers in it dropped
            return [([self.image_token] * (images * self.image_tokens), False),
                    (self.encode(text.replace(MARKER, " ")) + [self.end], True)]
        value = self._conversation(text)
        markers = sum(content.count(MARKER) for _, content in value)
        if markers != images:
            raise BadImage(f"the conversation holds {markers} {MARKER} marker(s) for the sample's {images} image(s); "
                           f"each image needs one {MARKER} where it belongs in the text")
        if self.template is not None:
            return [self.rendered(value)]
        return [(self._with_runs(content) + ([self.end] if role in ASSISTANT_ROLES else []),
                 role in ASSISTANT_ROLES) for role, content in value]

    def rendered(self, turns: list[tuple[str, str]]) -> tuple[list[int], list[bool]]:
        """The conversation through the chat template: (ids, trained per token). The text is cut at each <image>
        marker and the pieces tokenised one by one (as an HF processor's special <image> token splits it) with a
        placeholder run between them; trained tokens are those in the template's assistant spans (each answer and
        its end-of-turn text: titanlike/data/chat.py, the spans SFT data trains on)."""
        from titanlike.data.chat import ChatTemplateError, token_mask

        messages = [{"role": ROLES.get(role, role), "content": content} for role, content in turns]
        try:
            text, spans = self.template.assistant_spans(messages)
        except ChatTemplateError as e:
            raise BadImage(str(e)) from None
        ids, trained, start = [], [], 0
        for k, piece in enumerate(text.split(MARKER)):
            if k:
                ids += [self.image_token] * self.image_tokens
                trained += [False] * self.image_tokens
            got, offsets = self.tokenizer.encode_with_offsets(piece)
            ids += list(got)
            trained += [bool(m) for m in token_mask([(a + start, b + start) for a, b in offsets], spans)]
            start += len(piece) + len(MARKER)
        return ids, trained

    def _conversation(self, text: str) -> list[tuple[str, str]]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise BadImage(f"not JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(value, dict):
            value = value.get(self.messages_key, value.get("conversations"))
        if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
            raise BadImage(f"not a conversation: want a list of turns, or {{\"{self.messages_key}\" or "
                           "\"conversations\": [...]}, each {\"from\"/\"role\", \"value\"/\"content\"}")
        out = []
        for t in value:
            role, content = t.get("from", t.get("role")), t.get("value", t.get("content"))
            if not isinstance(role, str) or not isinstance(content, str):
                raise BadImage(f"turn {t!r:.60} has no role and text (\"from\"/\"role\", \"value\"/\"content\")")
            out.append((role, content))
        return out

    def sample(self, images: int, raw: bytes) -> tuple[list[int], list[bool]]:
        """(tokens, trained per token) of one sample's text, placeholder runs included, before any cut."""
        tokens, trained = [], []
        for ids, train in self.turns(raw, images):
            tokens += ids
            trained += train if isinstance(train, list) else [train] * len(ids)
        return tokens, trained

    def __call__(self, images: list[np.ndarray], raw: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        return self.row([(images, *self.sample(len(images), raw))])

    def row(self, parts: list[tuple[list[np.ndarray], list[int], list[bool]]], packed: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The row of one sample, or of several end to end (data.wds_layout = "pack": the caller checked that they
        fit). Their images fill the slots in order, so the row's k-th placeholder run is still slot k. Each sample's
        labels are its own next tokens: its last token predicts nothing (the next sample is another document).
        Packed rows carry each sample's token count in labels[:n] (the pixel part's labels, otherwise unused), from
        which the objective numbers the documents (models/llava/objective.py)."""
        room = self.seq_len - self.head
        if len(parts) == 1 and len(parts[0][1]) > room:
            images, tokens, trained = parts[0]
            # too long: the end is cut, never inside a placeholder run (the objective refuses a partial run); the
            # images whose runs fall past the cut leave their slots empty, so run k still pairs with slot k
            marks = [p for p, t in enumerate(tokens) if t == self.image_token]
            before = sum(p < room for p in marks)
            whole = before - before % self.image_tokens
            cut = room if whole == before else marks[whole]  # a partial run: cut at its start
            parts = [(images, tokens[:cut], trained[:cut])]
        ids = torch.zeros(self.seq_len, dtype=torch.int64)
        labels = torch.full_like(ids, IGNORE_INDEX)
        slot, at = 0, self.head
        for d, (images, tokens, trained) in enumerate(parts):
            kept = sum(t == self.image_token for t in tokens) // self.image_tokens
            for image in images[:kept]:
                ids[slot * self.pixels:(slot + 1) * self.pixels] = torch.from_numpy(image.astype(np.int64).reshape(-1))
                slot += 1
            ids[at:at + len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            # position p predicts token p + 1: a target only where that token belongs to a trained turn
            nxt = torch.tensor(tokens[1:], dtype=torch.int64)
            keep = torch.tensor(trained[1:], dtype=torch.bool)
            labels[at:at + len(tokens) - 1] = nxt.masked_fill(~keep, IGNORE_INDEX)
            if packed:
                labels[d] = len(tokens)
            at += len(tokens)
        return ids, labels
