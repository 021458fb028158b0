"""Raw text and a vocab.txt for BERT's debug run (configs/bert_megatron_debug.toml), from the embedded stdlib corpus.

    python scripts/bert_debug_data.py data/bert_debug
    python scripts/preprocess_data.py --input data/bert_debug/docs.jsonl --output-prefix data/bert_debug/stdlib \
        --tokenizer-type BertWordPieceLowerCase --vocab-file data/bert_debug/vocab.txt \
        --split-sentences --sentence-splitter rules

The documents are the standard library's docstrings (English prose, one JSONL document per module: the BERT data
needs documents of several sentences); the vocabulary is BERT's special tokens, every character seen (alone and as a
"##" continuation, so every word tokenizes) and the most frequent lower-cased words. Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import ast
import collections
import json
import re
import sys
from pathlib import Path

from titanlike.data.stdlib_corpus import list_stdlib_files

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_WORD = re.compile(r"[a-z]+|[0-9]|[^\sa-z0-9]")  # BERT's basic tokenizer: words, digits, one punctuation mark each


def docstrings(path: Path) -> str:
    """A module's docstrings joined into one document ("" when it does not parse)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    texts = [ast.get_docstring(n) or "" for n in nodes]
    return " ".join(" ".join(t.split()) for t in texts if t.count(".") >= 2)  # prose: two sentences at least


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="folder for docs.jsonl and vocab.txt")
    p.add_argument("--max-bytes", type=int, default=3_000_000, help="stop after this much text")
    p.add_argument("--words", type=int, default=4000, help="whole words in the vocabulary")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = list_stdlib_files(max_bytes=None)
    counts: collections.Counter = collections.Counter()
    chars: set[str] = set()
    total = 0
    with open(out / "docs.jsonl", "w") as f:
        for rel in corpus.files:
            text = docstrings(corpus.root / rel)
            if not text.isascii() or len(text) < 200:
                continue
            f.write(json.dumps({"text": text}) + "\n")
            words = _WORD.findall(text.lower())
            counts.update(w for w in words if w.isalpha() and len(w) > 1)
            chars.update(c for w in words for c in w)
            total += len(text)
            if total >= a.max_bytes:
                break
    singles = sorted(chars)
    vocab = SPECIALS + singles + [f"##{c}" for c in singles if c.isalnum()]
    vocab += [w for w, _ in counts.most_common(a.words)]
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    print(f"{out / 'docs.jsonl'}: {total:,} bytes of docstrings; {out / 'vocab.txt'}: {len(vocab)} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
