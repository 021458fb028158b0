"""JSONL -> Megatron indexed .bin/.idx: the work behind scripts/preprocess_data.py (Megatron's flags).

    python scripts/preprocess_data.py --input data.jsonl[.gz] --output-prefix out/my --json-keys text \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --append-eod --workers 8

writes out/my_text_document.{bin,idx} (one pair per json key, as Megatron names them) plus .stats.json. With
--split-sentences (titanlike/data/sentences.py) every sentence is a sequence and the document index groups them:
out/my_text_sentence.{bin,idx}, what Megatron's BERT and T5 datasets read. The main
process reads lines and writes output in input order; `--workers` processes parse JSON and tokenise chunks of lines,
so the output is byte-identical for any worker count. Bad lines (invalid JSON, missing key, non-UTF-8, empty
document) are skipped, counted and listed with file:line at the end; `--strict` stops at the first one and leaves
no output. Files are written under temporary names and renamed when complete.
"""
from __future__ import annotations

import collections
import gzip
import itertools
import multiprocessing as mp
import os
import resource
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np

from titanlike.config.sections import Data
from titanlike.data.indexed import IndexedDatasetWriter, optimal_dtype
from titanlike.data.streaming import expand_files, parse_json_line
from titanlike.data.tokenizers.base import LONG_TEXT_CHARS

# A task is 256 lines or 1 MB, whichever comes first: small enough for a live bar and to spread a few huge
# documents over the workers, large enough to amortise the pickling.
_CHUNK_LINES, _CHUNK_BYTES = 256, 1 << 20
_SHOWN_BAD = 20

# The flag that sets each [data] field here (tokenizer and tokenizer_model are both --tokenizer-model).
_FLAGS = {"tokenizer": "--tokenizer-model", "tokenizer_model": "--tokenizer-model",
          "tokenizer_type": "--tokenizer-type", "vocab_file": "--vocab-file", "merge_file": "--merge-file",
          "eod_token": "--eod-token", "builtin_vocab_size": "--vocab-size",
          "vocab_extra_ids": "--vocab-extra-ids"}


@dataclass
class FlagNamedData(Data):
    """A [data] section set from this tool's flags: tokenizer errors name the flags (`knob_names`), not data.* keys."""
    knob_names: dict[str, str] = field(default_factory=dict)


def tokenizer_config(args) -> FlagNamedData:
    """The [data] section build_tokenizer reads, with its tokenizer fields from the Megatron flags and the rest as a
    training run's defaults. --vocab-size is NullTokenizer's id range, which a [data] section gives as
    builtin_vocab_size; for any other tokenizer it is ignored, so the builtin BPE stays the one a training run with
    the default builtin_vocab_size uses."""
    from titanlike.data.tokenizers import TOKENIZER_TYPES

    null = TOKENIZER_TYPES.get(args.tokenizer_type.lower()) == "null"
    base = FlagNamedData(knob_names=dict(_FLAGS))
    return replace(base, tokenizer=args.tokenizer_model or "builtin", tokenizer_type=args.tokenizer_type,
                   tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file, merge_file=args.merge_file,
                   cache_dir=args.cache_dir,
                   builtin_vocab_size=args.vocab_size if null and args.vocab_size else Data.builtin_vocab_size,
                   bos_token="", eos_token="", eod_token=args.eod_token,
                   vocab_extra_ids=getattr(args, "vocab_extra_ids", 0))


# ---------------------------------------------------------------------------------------------------- workers

_W: dict = {}


def _init_worker(tok_cfg, keys, append_eod, prepend_bos, dtype, splitter=None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers says how many
    from titanlike.data.tokenizers import build_tokenizer

    tok = build_tokenizer(tok_cfg)
    split = None
    if splitter is not None:
        from titanlike.data.sentences import build_splitter

        split = build_splitter(*splitter)[0]
    _W.update(tok=tok, keys=keys, post=[tok.eod_id] if append_eod else [], pre=[tok.bos_id] if prepend_bos else [],
              dtype=dtype, split=split)


def _encode_sentences(texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Documents -> (token ids, sentence lengths) per document, as Megatron's --split-sentences: each sentence
    encoded alone, empty ones dropped, --prepend-bos / --append-eod joined to the first / last sentence."""
    split, tok, pre, post = _W["split"], _W["tok"], _W["pre"], _W["post"]
    ids, lens = [], []
    for text in texts:
        sents = [s for s in (tok.encode(t) for t in split(text)) if s]
        if sents:
            sents[0], sents[-1] = pre + sents[0], sents[-1] + post
        ids.append([t for s in sents for t in s])
        lens.append([len(s) for s in sents])
    return ids, lens


def _encode_chunk(chunk: list[tuple[int, int, bytes]]):
    """Lines -> (per key: tokens, doc lengths), bad lines [(file, line, why)], documents kept."""
    keys, tok, pre, post = _W["keys"], _W["tok"], _W["pre"], _W["post"]
    good: list[tuple[int, int]] = []
    texts: dict[str, list[str]] = {k: [] for k in keys}
    bad = []
    for f, lineno, raw in chunk:
        got = {}
        for k in keys:
            text, err = parse_json_line(raw, k)
            if err:
                bad.append((f, lineno, err))
                break
            got[k] = text
        else:
            good.append((f, lineno))
            for k in keys:
                texts[k].append(got[k])
    # One encode per document: with the Rust thread pool off (one core per worker) this beats encode_batch. A huge
    # document (a JSONL line of megabytes) is encoded in pieces, into an array (Tokenizer.encode_array).
    sentence_lens = {}
    if _W["split"] is not None:
        encoded = {k: _encode_sentences(texts[k]) for k in keys}
        ids, sentence_lens = {k: e[0] for k, e in encoded.items()}, {k: e[1] for k, e in encoded.items()}
        pre, post = [], []  # joined to the sentences already
    else:
        ids = {k: [tok.encode(t) if len(t) <= LONG_TEXT_CHARS else tok.encode_array(t) for t in texts[k]]
               for k in keys}
    kept = []
    for i, (f, lineno) in enumerate(good):
        if any(not len(ids[k][i]) for k in keys):  # e.g. whitespace that a tokenizer drops: as empty as ""
            bad.append((f, lineno, "empty document (no tokens)"))
        else:
            kept.append(i)
    out = {}
    for k in keys:
        docs = [ids[k][i] for i in kept]
        lengths = np.fromiter((len(pre) + len(d) + len(post) for d in docs), dtype=np.int64, count=len(docs))
        if any(isinstance(d, np.ndarray) for d in docs):
            flat = np.concatenate([np.asarray(x, dtype=_W["dtype"]) for d in docs for x in (pre, d, post)])
        else:
            flat = np.fromiter(itertools.chain.from_iterable(pre + d + post for d in docs), dtype=_W["dtype"],
                               count=int(lengths.sum()))
        if k in sentence_lens:  # (tokens, sentence lengths, sentences per document)
            sent = [sentence_lens[k][i] for i in kept]
            out[k] = (flat, np.fromiter(itertools.chain.from_iterable(sent), dtype=np.int64),
                      np.fromiter((len(x) for x in sent), dtype=np.int64, count=len(sent)))
        else:
            out[k] = (flat, lengths)
    bad.sort(key=lambda b: (b[0], b[1]))
    return out, bad, len(kept)


# ---------------------------------------------------------------------------------------------------- main

def _read_chunks(files: list[str], progress):
    for fi, path in enumerate(files):
        raw_file = open(path, "rb")
        f = gzip.open(raw_file) if path.endswith(".gz") else raw_file
        last = 0
        with raw_file, f:
            chunk, size = [], 0
            for lineno, line in enumerate(f, 1):
                chunk.append((fi, lineno, line))
                size += len(line)
                if len(chunk) == _CHUNK_LINES or size >= _CHUNK_BYTES:
                    yield chunk
                    chunk, size = [], 0
                    pos = raw_file.tell()
                    progress(pos - last)
                    last = pos
            if chunk:
                yield chunk
            progress(os.path.getsize(path) - last)


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children: throughput per CPU-second is comparable on a busy box."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def no_document_error(files: list[str], bad_counts: collections.Counter, first_bad: dict[str, str]) -> str:
    """One line: no line of the input gave a document; what was wrong, the first example, the flag to fix."""
    more = ", ..." if len(files) > 3 else ""
    where = files[0] if len(files) == 1 else f"{len(files)} input files ({', '.join(files[:3])}{more})"
    if not bad_counts:
        return f"{where}: no lines to preprocess (empty input); give --input files with one JSON object per line"
    top = bad_counts.most_common(1)[0][0]
    what = ", ".join(f"{why} x{n}" for why, n in bad_counts.most_common())
    if top.startswith("no key"):
        fix = "name the field that holds the text with --json-keys (the first bad line shows the keys found)"
    elif top.startswith("key "):
        fix = "name a field that holds a string with --json-keys"
    else:
        fix = {"invalid JSON": "--input must be JSON Lines: one JSON object per line",
               "not valid UTF-8": "re-encode the input as UTF-8 (e.g. iconv -f latin1 -t utf-8)"}.get(
            top, "the documents are empty: give input with text")
    return f"{where}: no usable document, every line was bad ({what}; first: {first_bad[top]}); {fix}"


def run(args) -> dict:
    """Preprocess; returns a summary dict. Raises SystemExit(1) on --strict failures, ValueError when no line of the
    input gives a document (nothing is written)."""
    from tqdm import tqdm

    from titanlike.data.tokenizers import build_tokenizer

    if args.workers < 1:
        raise SystemExit(f"error: --workers={args.workers} must be >= 1")
    files = expand_files(args.input, key="--input")
    tok_cfg = tokenizer_config(args)
    tok = build_tokenizer(tok_cfg)
    dtype = optimal_dtype(tok.vocab_size)
    keys = list(args.json_keys)
    splitter, how_split = None, "documents"
    if args.split_sentences:  # fails here, before any output, when the splitter's data is missing
        from titanlike.data.sentences import build_splitter

        splitter = (getattr(args, "sentence_splitter", "punkt"), args.lang)
        how_split = build_splitter(*splitter)[1]
        print(f"splitting documents into sentences with {how_split}", file=sys.stderr)
    level = "sentence" if splitter else "document"  # Megatron's output names: <prefix>_<key>_<level>.bin/.idx
    writers = {k: IndexedDatasetWriter(f"{args.output_prefix}_{k}_{level}", dtype) for k in keys}
    init = (tok_cfg, keys, args.append_eod, args.prepend_bos, dtype, splitter)
    bad_counts: collections.Counter = collections.Counter()
    first_bad: dict[str, str] = {}  # reason -> its first "file:line: why", for the no-document error
    shown: list[str] = []
    docs = tokens = 0
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    bar = tqdm(total=sum(os.path.getsize(f) for f in files), unit="B", unit_scale=True, desc="preprocessing",
               disable=args.no_progress, mininterval=0.5, file=sys.stderr)
    pool = None
    try:
        if args.workers == 1:
            _init_worker(*init)
            results = map(_encode_chunk, _read_chunks(files, bar.update))
        else:
            pool = mp.get_context("fork" if hasattr(os, "fork") else "spawn").Pool(
                args.workers, initializer=_init_worker, initargs=init)
            results = pool.imap(_encode_chunk, _read_chunks(files, bar.update))
        for out, bad, n in results:
            for f, lineno, why in bad:
                where = f"{files[f]}:{lineno}: {why}"
                if args.strict:
                    raise SystemExit(f"error: bad input line (--strict): {where}. Fix or drop the line, or run "
                                     "without --strict to skip bad lines")
                bad_counts[why.split(" (")[0]] += 1
                first_bad.setdefault(why.split(" (")[0], where)
                if len(shown) < _SHOWN_BAD:
                    shown.append(where)
            for k in keys:
                writers[k].add_documents(*out[k])
            docs += n
            tokens += int(out[keys[0]][0].size)
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"{docs / dt:,.0f} docs/s, {tokens / dt:,.0f} tok/s", refresh=False)
        if pool is not None:
            pool.close()
            pool.join()  # reaped workers count in RUSAGE_CHILDREN below
            pool = None
        if docs == 0:  # an empty .bin/.idx would only fail later, at training start-up
            raise ValueError(no_document_error(files, bad_counts, first_bad))
        elapsed = time.perf_counter() - t0
        cpu = _cpu_seconds() - cpu0
        summary = {"cpu_seconds": round(cpu, 3), "tokens_per_cpu_s": tokens / max(cpu, 1e-9),
                   "documents": docs, "tokens": tokens, "bad_lines": sum(bad_counts.values()),
                   "bad_by_reason": dict(bad_counts), "seconds": round(elapsed, 3),
                   "docs_per_s": docs / max(elapsed, 1e-9), "tokens_per_s": tokens / max(elapsed, 1e-9),
                   "workers": args.workers, "inputs": files}
        meta = {"tokenizer": repr(tok), "tokenizer_fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
                "append_eod": args.append_eod, "eod_id": tok.eod_id, "bad_lines": summary["bad_lines"],
                "split": how_split}
        summary["outputs"] = [writers[k].finalize({**meta, "json_key": k}) for k in keys]
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    print(f"preprocessed {docs:,} documents, {tokens:,} tokens from {len(files)} file(s) in {elapsed:.1f}s "
          f"({summary['docs_per_s']:,.0f} docs/s, {summary['tokens_per_s']:,.0f} tokens/s, {args.workers} "
          f"worker(s); {summary['tokens_per_cpu_s']:,.0f} tokens per CPU-second over {cpu:.1f} CPU-s) -> "
          f"{', '.join(p + '.bin/.idx' for p in summary['outputs'])}", file=sys.stderr)
    if bad_counts:
        reasons = ", ".join(f"{n} {why}" for why, n in bad_counts.most_common())
        print(f"skipped {summary['bad_lines']} bad line(s): {reasons}", file=sys.stderr)
        for line in shown:
            print(f"  {line}", file=sys.stderr)
        if summary["bad_lines"] > len(shown):
            print(f"  ... and {summary['bad_lines'] - len(shown)} more (use --strict to stop at the first)",
                  file=sys.stderr)
    return summary
