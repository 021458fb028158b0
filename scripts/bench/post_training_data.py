"""Inputs of the post-training benchmarks (titanlike against TRL, scripts/bench/peer_trl.py), written once for both.

    python scripts/bench/post_training_data.py /tmp/titanlike_post        # chat.jsonl, pairs.jsonl, tokenizer/

- `chat.jsonl`: conversations for SFT, `{"messages": [...]}`. The user gives a passage cut from a Python standard
  library source file and asks for its continuation; the assistant replies with the passage that follows it in that
  file; about a third go on for a second turn ("Go on." and the next passage). Passage lengths are drawn from a seeded
  generator, so conversations vary in length as real SFT data does.
- `pairs.jsonl`: preference pairs for DPO in TRL's conversational format: `prompt` a list with one user message,
  `chosen` and `rejected` one assistant message each; chosen is the true continuation, rejected a passage of about
  the same length from another file.
- `tokenizer/`: titanlike's builtin byte-level BPE (trained on the stdlib, data.builtin_vocab_size ids) with the
  ChatML markers `<|im_start|>` and `<|im_end|>` added as special tokens, and a ChatML template that renders exactly as
  titanlike's built-in "chatml" but marks each assistant reply with `{% generation %}`: TRL's assistant_only_loss
  needs those markers, and titanlike's masks equal transformers' on such a template (the reply and its `<|im_end|>`
  are trained, the newline after it is not). Written with titanlike's HF export (write_tokenizer), which loads the
  folder back in transformers' AutoTokenizer and checks text and chat rendering against titanlike's. Both sides read
  this folder: transformers with AutoTokenizer.from_pretrained, titanlike with `data.tokenizer=<folder>` (the
  template comes from the folder: data.chat_template stays empty).

Deterministic for a given interpreter (the stdlib differs between Python versions, so write it on the machine that
benchmarks). A `manifest.json` records the settings; a later call with the same settings reuses the files.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from types import SimpleNamespace

# ChatML as titanlike's built-in (titanlike/data/chat.py CHATML), the assistant's reply and end-of-turn inside
# {% generation %} (transformers' return_assistant_tokens_mask, which TRL's assistant_only_loss reads).
CHATML_GENERATION = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
FILES = ("chat.jsonl", "pairs.jsonl", "tokenizer/tokenizer.json", "tokenizer/chat_template.jinja")
# Passage lengths in characters (~3 characters per token with the builtin BPE on Python source).
PROMPT_CHARS = (300, 2000)
REPLY_CHARS = (600, 4000)
# Enough for a few dozen steps of every benchmark case (~1,200 tokens a conversation, ~1,000 a pair's side); DPO
# precomputes its reference over every pair on both sides, so the pairs stay few.
DEFAULT_CONVERSATIONS = 2000
DEFAULT_PAIRS = 256


class _Passages:
    """Consecutive passages of the stdlib's files, cut at line ends after a seeded number of characters; the corpus
    is walked again (with other cuts) when used up."""

    def __init__(self, rng: random.Random):
        from titanlike.data.stdlib_corpus import list_stdlib_files

        self.rng, self.corpus = rng, list_stdlib_files()
        self.files = iter(())
        self.next_file()

    def next_file(self) -> None:
        while True:
            for rel, path in self.files:
                try:
                    self.text = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                self.rel, self.pos = rel, self.rng.randrange(0, 200)  # another start on every walk
                return
            self.files = zip(self.corpus.files, self.corpus.paths())

    def cut(self, chars: tuple[int, int]) -> str | None:
        """The file's next passage of about `chars` characters; None (and on to the next file) at its end."""
        while self.pos < len(self.text):
            end = self.text.find("\n", self.pos + self.rng.randint(*chars))
            end = len(self.text) if end < 0 else end + 1
            # No leading whitespace: the generation prompt's last "\n" then stays a token of its own (the BPE's
            # pre-tokeniser joins a newline with the spaces after it), so the prompt's tokens are the start of
            # prompt + reply's, which titanlike's DPO requires of chat pairs (TRL cuts at the common prefix).
            chunk = self.text[self.pos:end].lstrip()
            self.pos = end
            if chunk.strip():
                return chunk
        self.next_file()
        return None

    def exchange(self) -> tuple[str, str, str]:
        """(file, passage, the passage after it) from one file."""
        while True:
            rel, first = self.rel, self.cut(PROMPT_CHARS)
            reply = self.cut(REPLY_CHARS) if first is not None else None
            if reply is not None:
                return rel, first, reply


def _ask(rel: str, passage: str) -> dict:
    return {"role": "user", "content": f"Continue this passage of {rel}:\n\n{passage}"}


def conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cuts = _Passages(rng)
    out = []
    while len(out) < n:
        rel, first, reply = cuts.exchange()
        msgs = [_ask(rel, first), {"role": "assistant", "content": reply}]
        if rng.random() < 0.35 and cuts.rel == rel and (more := cuts.cut(REPLY_CHARS)) is not None:
            msgs += [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": more}]
        out.append({"messages": msgs})
    return out


def preference_pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed + 1)
    cuts = _Passages(rng)
    pool = [cuts.exchange() for _ in range(n)]  # (file, prompt passage, its continuation)
    out = []
    for i, (rel, first, reply) in enumerate(pool):
        # rejected: the continuation of another file's passage, the nearest in length among a few seeded candidates
        others = [pool[(i + rng.randrange(1, len(pool))) % len(pool)] for _ in range(8)] if len(pool) > 1 else []
        others = [o for o in others if o[0] != rel and o[2] != reply] or [(rel, "", reply[::-1])]
        rejected = min(others, key=lambda o: abs(len(o[2]) - len(reply)))[2]
        out.append({"prompt": [_ask(rel, first)], "chosen": [{"role": "assistant", "content": reply}],
                    "rejected": [{"role": "assistant", "content": rejected}]})
    return out


def write_tokenizer_folder(out: str, vocab_size: int, cache_dir: str = "") -> None:
    """The builtin BPE + the ChatML special tokens + CHATML_GENERATION, as an HF tokenizer folder `out`."""
    from titanlike.checkpoint.hf_tokenizer import write_tokenizer
    from titanlike.data.chat import BUILTIN_TEMPLATES, ChatTemplate
    from titanlike.data.tokenizers.hf import HFTokenizer, builtin_tokenizer

    base = builtin_tokenizer(vocab_size, cache_dir)
    with tempfile.TemporaryDirectory() as stage:
        hf = base._tok
        hf.add_special_tokens(list(CHATML_TOKENS))
        hf.save(os.path.join(stage, "tokenizer.json"))
        template = os.path.join(stage, "chat_template.jinja")
        with open(template, "w", encoding="utf-8") as f:
            f.write(CHATML_GENERATION)
        tok = HFTokenizer(os.path.join(stage, "tokenizer.json"))
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
        for gen in (False, True):  # the markers change nothing in the text
            if ChatTemplate(CHATML_GENERATION).render(probe, gen) != ChatTemplate(BUILTIN_TEMPLATES["chatml"]).render(
                    probe, gen):
                raise AssertionError("CHATML_GENERATION renders differently from the built-in chatml")
        os.makedirs(out, exist_ok=True)
        write_tokenizer(tok, SimpleNamespace(dataset="chat", chat_template=template, add_bos=False), out)
    for name in ("tokenizer.json", "chat_template.jinja"):  # write_tokenizer removes what transformers disagrees with
        if not os.path.isfile(os.path.join(out, name)):
            raise RuntimeError(f"{out}/{name} was not kept: transformers' AutoTokenizer disagrees with titanlike's "
                               "tokenizer or template (see the warning above)")


def check_pairs(pairs: list[dict], tokenizer_dir: str) -> None:
    """Every pair's prompt (with the generation prompt) must tokenise as the start of prompt + each reply: titanlike's
    DPO refuses chat pairs where it does not, and TRL would cut the prompt short."""
    from titanlike.data.chat import load_chat_template, render_with_masks
    from titanlike.data.tokenizers.hf import HFTokenizer

    tok = HFTokenizer(os.path.join(tokenizer_dir, "tokenizer.json"))
    template = load_chat_template(SimpleNamespace(chat_template=""), tok)
    for i, row in enumerate(pairs):
        p_ids = render_with_masks(template, row["prompt"], tok, add_generation_prompt=True)[0]
        for side in ("chosen", "rejected"):
            if render_with_masks(template, row["prompt"] + row[side], tok)[0][:len(p_ids)] != p_ids:
                raise AssertionError(f"pair {i}: the prompt's tokens are not the start of prompt + {side}'s")


def _write_jsonl(path: str, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def ensure(out: str, conversations_n: int | None = None, pairs_n: int | None = None, seed: int = 0,
           vocab_size: int = 2048, cache_dir: str = "") -> str:
    """Write the benchmark inputs into `out` unless they are there with these settings (counts left None: any count
    already there, else the defaults); returns `out`."""
    settings = {"conversations": conversations_n, "pairs": pairs_n, "seed": seed, "vocab_size": vocab_size,
                "version": 3}
    manifest = os.path.join(out, "manifest.json")
    if os.path.isfile(manifest) and all(os.path.isfile(os.path.join(out, f)) for f in FILES):
        with open(manifest) as f:
            have = json.load(f).get("settings", {})
        if all(v is None or have.get(k) == v for k, v in settings.items()):
            return out
    conversations_n = DEFAULT_CONVERSATIONS if conversations_n is None else conversations_n
    pairs_n = DEFAULT_PAIRS if pairs_n is None else pairs_n
    settings.update(conversations=conversations_n, pairs=pairs_n)
    os.makedirs(out, exist_ok=True)
    if os.path.exists(manifest):
        os.remove(manifest)
    if os.path.isdir(os.path.join(out, "tokenizer")):
        shutil.rmtree(os.path.join(out, "tokenizer"))
    write_tokenizer_folder(os.path.join(out, "tokenizer"), vocab_size, cache_dir)
    chat, pairs = conversations(conversations_n, seed), preference_pairs(pairs_n, seed)
    check_pairs(pairs, os.path.join(out, "tokenizer"))
    _write_jsonl(os.path.join(out, "chat.jsonl"), chat)
    _write_jsonl(os.path.join(out, "pairs.jsonl"), pairs)
    chars = sum(len(m["content"]) for c in chat for m in c["messages"])
    with open(manifest, "w") as f:
        json.dump({"settings": settings, "conversations": len(chat), "pairs": len(pairs), "chat_chars": chars}, f,
                  indent=1)
    print(f"post_training_data: wrote {len(chat)} conversations ({chars / 1e6:.1f}M characters), {len(pairs)} "
          f"pairs and the tokenizer to {out}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "titanlike_post"))
    p.add_argument("--conversations", type=int, default=DEFAULT_CONVERSATIONS)
    p.add_argument("--pairs", type=int, default=DEFAULT_PAIRS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=2048, help="the builtin BPE's size (data.builtin_vocab_size)")
    a = p.parse_args()
    ensure(a.out, a.conversations, a.pairs, a.seed, a.vocab_size)


if __name__ == "__main__":
    main()
