r"""The peer of scripts/bench/benchmark.py: torchtitan 0.2.2 on local synthetic inputs, with the benchmarks' flavors.

Usually started through scripts/bench/peer_torchtitan.sh, which adds the run defaults. Directly, under torchrun
(one process per GPU; everything after `--` goes to torchtitan unchanged):

    torchrun --standalone --nproc_per_node 2 scripts/bench/peer_torchtitan.py -- \
        --model.name llama3 --model.flavor 8B_4L --training.seq_len 8192 --training.local_batch_size 2 --compile.enable
    python scripts/bench/peer_torchtitan.py --prepare-only   # only write the inputs

Inputs, written under --work without network (the GPU machine has none):
  tok/tokenizer.json, tok/tokenizer_config.json   a word-level tokenizer over N_WORDS words "w0", "w1", ... plus
                                                  begin/end-of-text and unknown tokens
  data/train.json                                 JSON Lines, {"text": "..."} per document, random words of that
                                                  vocabulary (seeded, so every run and rank sees the same corpus)
The launcher points torchtitan at them (--model.hf_assets_path, --training.dataset c4_test, whose loader reads a
local folder, --training.dataset_path). The models keep their own vocabulary size (Llama 3: 128,256), so compute per
token is that of the real model; the tokenizer only has to produce ids below it.

Flavors added to torchtitan's own (per --model.name):
  llama3       1B          Llama-3.2-1B shape: dim 2048, 16 layers, 32 heads, 8 KV heads, ffn multiplier 1.5
               8B_4L       Llama 3 8B with 4 layers
  qwen3        30B-A3B_4L  Qwen3-30B-A3B with 4 layers (MoE on one GPU)
  deepseek_v3  16B_4L      DeepSeek-V3-16B with 4 layers
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
N_WORDS = 8000
# What this launcher runs, per torchtitan model (MODEL): the flavors the benchmark may ask the peer for.
PEER_FLAVORS = {"llama3": ("debugmodel", "1B", "8B", "8B_4L", "70B", "405B"), "qwen3": ("30B-A3B_4L", "30B-A3B"),
                "deepseek_v3": ("16B_4L", "16B")}


def _write_atomic(path: str, text: str) -> None:
    # Every torchrun rank prepares the same inputs at once: each writes its own temporary file and renames it into
    # place, so a reader never sees a half-written file, and the last rename wins with identical content.
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def prepare_inputs(work: str, docs: int = 400, words_per_doc: int = 6000, seed: int = 0) -> dict[str, str]:
    """Write the tokenizer and the corpus under `work`; returns the torchtitan paths {"tokenizer": ..., "data": ...}.

    Skipped when a previous call with the same parameters finished (its stamp is written last): a benchmark runs
    the peer once per case, and every rank calls this.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok_dir, data_dir = os.path.join(work, "tok"), os.path.join(work, "data")
    paths = {"tokenizer": tok_dir, "data": data_dir}
    stamp_path = os.path.join(work, "prepared.json")
    stamp = json.dumps({"n_words": N_WORDS, "docs": docs, "words_per_doc": words_per_doc, "seed": seed})
    files = [os.path.join(tok_dir, "tokenizer.json"), os.path.join(tok_dir, "tokenizer_config.json"),
             os.path.join(data_dir, "train.json")]
    try:
        with open(stamp_path, encoding="utf-8") as f:
            if f.read() == stamp and all(map(os.path.exists, files)):
                return paths
    except FileNotFoundError:
        pass
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)

    words = [f"w{i}" for i in range(N_WORDS)]
    vocab = {BOS: 0, EOS: 1, UNK: 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    _write_atomic(files[0], tokenizer.to_str())
    # torchtitan's HuggingFaceTokenizer finds the begin/end-of-text ids through these two keys
    _write_atomic(files[1], json.dumps({"bos_token": BOS, "eos_token": EOS}))

    rng = random.Random(seed)
    lines = (json.dumps({"text": " ".join(rng.choices(words, k=words_per_doc))}) for _ in range(docs))
    # "train" in the name is how the datasets library assigns the file to the split c4_test loads
    _write_atomic(files[2], "\n".join(lines) + "\n")
    _write_atomic(stamp_path, stamp)
    return paths


def input_flags(paths: dict[str, str]) -> list[str]:
    """torchtitan flags that read the prepared inputs; the caller's flags come after them and so can override."""
    return ["--model.hf_assets_path", paths["tokenizer"], "--training.dataset", "c4_test",
            "--training.dataset_path", paths["data"]]


def run_torchtitan(torchtitan_args: list[str]) -> None:
    """Register the extra flavors and run torchtitan's trainer with `torchtitan_args` (its own flag syntax)."""
    # ConfigManager.parse_args defaults to sys.argv[1:] as it was when torchtitan.config was first imported, so
    # argv must hold torchtitan's flags before any torchtitan import.
    sys.argv = [sys.argv[0], *torchtitan_args]
    import dataclasses

    from torchtitan.models.deepseek_v3 import deepseekv3_args
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
    from torchtitan.models.qwen3 import qwen3_args
    from torchtitan.train import Trainer, main

    # The train specs hold these very dicts, so an added key is a flavor --model.flavor can name.
    llama3_args["1B"] = TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                                             multiple_of=256, rope_theta=500000)
    # 4-layer cuts: the full layer shapes (what throughput per layer depends on) on one or two GPUs
    llama3_args["8B_4L"] = dataclasses.replace(llama3_args["8B"], n_layers=4)
    qwen3_args["30B-A3B_4L"] = dataclasses.replace(qwen3_args["30B-A3B"], n_layers=4)
    deepseekv3_args["16B_4L"] = dataclasses.replace(deepseekv3_args["16B"], n_layers=4)
    main(Trainer)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launcher's arguments, torchtitan's): torchtitan's follow the first `--`.

    Split by hand rather than by argparse, which would try to match torchtitan's dotted flags against its own.
    """
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def main(argv: list[str] | None = None) -> None:
    own, torchtitan_args = split_argv(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [--work DIR] [--prepare-only] ... -- [torchtitan flags]")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "ttwork"),
                   help="folder for the tokenizer and the corpus")
    p.add_argument("--docs", type=int, default=400, help="documents in the corpus")
    p.add_argument("--words-per-doc", type=int, default=6000, help="words (= tokens) per document")
    p.add_argument("--prepare-only", action="store_true", help="write the inputs and stop (no torchtitan needed)")
    a = p.parse_args(own)
    paths = prepare_inputs(a.work, a.docs, a.words_per_doc)
    if a.prepare_only:
        print(f"inputs ready: tokenizer {paths['tokenizer']}, corpus {paths['data']}")
        return
    run_torchtitan(input_flags(paths) + torchtitan_args)


if __name__ == "__main__":
    main()
