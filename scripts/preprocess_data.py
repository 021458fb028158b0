"""Tokenise JSONL into Megatron's indexed .bin/.idx format (flags compatible with Megatron's tools/preprocess_data.py).

    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --json-keys text \\
        --tokenizer-type Llama3Tokenizer --tokenizer-model /models/my_model/tokenizer.model --append-eod --workers 8

The work is titanlike/data/preprocess.py's run(); docs/data.md describes the format. Exit status: 0 done (bad lines, if
any, listed), 1 stopped by --strict, 2 bad arguments or files (including input where no line gives a document).
"""
from __future__ import annotations

import argparse
import sys

from titanlike.data.preprocess import run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, nargs="+", help="JSONL file(s) (.gz too), globs or folders")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract; one output per key")
    g.add_argument("--split-sentences", action="store_true",
                   help="one sequence per sentence, grouped by document (BERT/T5 data): <prefix>_<key>_sentence")
    g.add_argument("--sentence-splitter", default="punkt", choices=["punkt", "rules"],
                   help="punkt: NLTK's trained model (needs `python -m nltk.downloader punkt_tab`); rules: NLTK's "
                        "untrained Punkt (no download, no abbreviation list)")
    g.add_argument("--keep-newlines", action="store_true", help="(Megatron, with --split-sentences) accepted")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="auto",
                   help="HuggingFaceTokenizer | GPT2BPETokenizer | TikTokenizer | Llama3Tokenizer | "
                        "SentencePieceTokenizer | Llama2Tokenizer | GPTSentencePieceTokenizer | NullTokenizer | "
                        "builtin | auto")
    g.add_argument("--tokenizer-model", default="", help="tokenizer.json / tokenizer.model file or folder")
    g.add_argument("--vocab-file", default="", help="GPT-2 vocab.json, or BertWordPiece*'s vocab.txt")
    g.add_argument("--vocab-extra-ids", type=int, default=0, help="BertWordPiece*: T5 sentinels <extra_id_N> to add")
    g.add_argument("--merge-file", default="", help="GPT-2 merges.txt")
    g.add_argument("--vocab-size", type=int, default=0, help="NullTokenizer: ids are below this")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    g.add_argument("--prepend-bos", action="store_true", help="prepend the BOS token to every document")
    g.add_argument("--eod-token", default="", help="text of the EOD token (default: the tokenizer's EOS)")
    g.add_argument("--lang", default="english", help="punkt's language, with --split-sentences")
    g.add_argument("--cache-dir", default="", help="builtin tokenizer cache (default ~/.cache/titanlike)")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path prefix; writes <prefix>_<key>_document.bin/.idx")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="(Megatron) only mmap exists")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenising processes (1 = in this process)")
    g.add_argument("--partitions", type=int, default=1, help="(Megatron) accepted; input is streamed, not split")
    g.add_argument("--log-interval", type=int, default=1000, help="(Megatron) accepted; a live bar shows progress")
    g.add_argument("--keep-sequential-samples", action="store_true", help="(Megatron) accepted: order is kept")
    g.add_argument("--strict", action="store_true", help="stop at the first bad line (no output is left)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    from titanlike.cli import run_main

    sys.exit(run_main(main))
