"""Data benchmarks (docs/benchmarks.md): stdlib sources as JSONL for preprocessing, and loader throughput.

    python scripts/bench/data_bench.py jsonl OUT.jsonl [--max-bytes N]        # the stdlib corpus as {"text": ...} lines
    python scripts/bench/data_bench.py loader PREFIX [--seq-len 2048] [--batch 8] [--workers 0] [--batches 400]

`loader` times build_dataloader on an indexed prefix (blend of one, shuffled train split) and prints tokens/s
as seen by one rank's training loop (next(batch) only, no model).
"""
from __future__ import annotations

import argparse
import json
import os
import time

from titanlike.data.stdlib_corpus import list_stdlib_files, read_texts


def write_jsonl(out: str, max_bytes: int | None) -> None:
    n = 0
    with open(out, "w", encoding="utf-8") as f:
        for text in read_texts(list_stdlib_files(max_bytes)):
            f.write(json.dumps({"text": text}) + "\n")
            n += 1
    print(f"wrote {n} documents, {os.path.getsize(out) / 1e6:.1f} MB -> {out}")


def loader_throughput(prefix: str, seq_len: int, batch: int, workers: int, batches: int, cache_dir: str) -> float:
    from titanlike.config.sections import Data
    from titanlike.data import build_dataloader

    cfg = Data(dataset="indexed", paths=[prefix], split="100,0,0", num_workers=workers, cache_dir=cache_dir)
    dl = build_dataloader(cfg, None, dp_rank=0, dp_degree=1, local_batch_size=batch, seq_len=seq_len, seed=0)
    it = iter(dl)
    for _ in range(10):  # warm-up: index build/cache, worker start, page cache
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        x, _ = next(it)
    dt = time.perf_counter() - t0
    rate = batches * batch * seq_len / dt
    print(f"loader: seq {seq_len} x batch {batch}, {workers} worker(s): {batches} batches in {dt:.2f}s = "
          f"{rate / 1e6:.2f}M tokens/s ({dt / batches * 1e3:.2f} ms/batch)")
    return rate


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("jsonl")
    j.add_argument("out")
    j.add_argument("--max-bytes", type=int, default=None)
    lo = sub.add_parser("loader")
    lo.add_argument("prefix")
    lo.add_argument("--seq-len", type=int, default=2048)
    lo.add_argument("--batch", type=int, default=8)
    lo.add_argument("--workers", type=int, default=0)
    lo.add_argument("--batches", type=int, default=400)
    lo.add_argument("--cache-dir", default="")
    a = p.parse_args()
    if a.cmd == "jsonl":
        write_jsonl(a.out, a.max_bytes)
    else:
        loader_throughput(a.prefix, a.seq_len, a.batch, a.workers, a.batches, a.cache_dir)


if __name__ == "__main__":
    main()
