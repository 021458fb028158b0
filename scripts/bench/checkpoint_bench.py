"""What checkpoint checksums cost (titanlike/checkpoint/integrity.py): one JSON line for docs/benchmarks.md.

    python scripts/bench/checkpoint_bench.py [--gib 16] [--device auto] [--folder DIR] [--io-threads 1]

Builds `--gib` GiB of fp32 tensors on the device, shaped like the block matrices of an 8B dense transformer (dim
4096, FFN 14336: ~30 GiB of fp32 weights; a rank of a sharded run writes a share of that, plus 2x for AdamW's
moments), then, one copy on disk at a time (the folder is deleted at the end, also on errors):

  save_s                  plain dcp.save (no checksums), fsynced, GB/s of it (the second of two: save_first_s also
                          pays for first-touch host memory)
  checksum_s              CRC32 of every chunk of the files just written (page cache warm, as after a real save),
                          with the thread count a save uses (integrity.threads_for("save"))
  verify_warm_s/_cold_s   checking them again, warm and after dropping the files from the page cache
                          (posix_fadvise DONTNEED), with the load-time thread count
  load_cold_s             dcp.load from the disk; verify_then_load_s: verify (cold) then dcp.load, as a resume does
  save_with_checksums_s   CheckpointManager, synchronous: write + checksums + commit (the loop waits for all of it)
  async_stall_s           CheckpointManager, async: what the training loop waits for (the copy to host memory)
  async_total_s           ... and the background write + checksums until the commit
  crc32_gbps / blake2b_gbps / sha256_gbps   one thread, 256 MiB in memory: why CRC32
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import zlib

import torch

# One block of an 8B dense transformer (dim 4096, 8 KV heads of 128, FFN 14336): q, k, v, o, and the 3 FFN matrices.
BLOCK = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (14336, 4096)]


def build_state(gib: float, device: torch.device) -> torch.nn.Module:
    module, left, i = torch.nn.Module(), int(gib * 2**30), 0
    gen = torch.Generator(device).manual_seed(0)
    while left > 0:
        rows, cols = BLOCK[i % len(BLOCK)]
        rows = min(rows, max(1, left // (4 * cols)))
        t = torch.empty(rows, cols, device=device).uniform_(generator=gen)  # random: nothing compresses
        module.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))
        left -= t.numel() * 4
        i += 1
    return module


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def drop_cache(folder: str) -> None:
    """Evict the (clean, fsynced) pages of every file from the page cache, so the next read comes from the disk."""
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def hash_speeds() -> dict:
    buf = memoryview(os.urandom(256 << 20))
    out = {}
    for name, fn in (("crc32", zlib.crc32), ("blake2b", lambda b: hashlib.blake2b(b).digest()),
                     ("sha256", lambda b: hashlib.sha256(b).digest())):
        t0 = time.perf_counter()
        fn(buf)
        out[f"{name}_gbps"] = round(len(buf) / (time.perf_counter() - t0) / 1e9, 2)
    return out


def run(args, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from titanlike.checkpoint import CheckpointManager, integrity
    from titanlike.checkpoint.states import quiet_dcp
    from titanlike.config.sections import Checkpoint

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    module = build_state(args.gib, device)
    sd = dict(module.state_dict())
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    gb = nbytes / 1e9
    save_threads, load_threads = integrity.threads_for("save"), integrity.threads_for("load")
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "cpus": os.cpu_count(), "torch": torch.__version__, "gib": round(nbytes / 2**30, 3),
           "tensors": len(sd), "io_threads": args.io_threads, "save_threads": save_threads,
           "load_threads": load_threads}

    plain = os.path.join(folder, "plain")
    for key in ("save_first_s", "save_s"):  # the first save also pays for the host memory's first touch
        shutil.rmtree(plain, ignore_errors=True)
        sync(device)
        t0 = time.perf_counter()
        with quiet_dcp():
            dcp.save(sd, storage_writer=FileSystemWriter(plain, thread_count=args.io_threads), no_dist=True)
        out[key] = time.perf_counter() - t0
    rels = sorted(integrity.own_files(plain, 0))
    t0 = time.perf_counter()
    sums = integrity.checksum_files(plain, rels, save_threads)
    out["checksum_s"] = time.perf_counter() - t0
    sizes = {rel: v["size"] for rel, v in sums.items()}
    for kind in ("warm", "cold"):
        if kind == "cold":
            drop_cache(plain)
        t0 = time.perf_counter()
        problems = integrity.verify(plain, sizes, sums, threads=load_threads)
        out[f"verify_{kind}_s"] = time.perf_counter() - t0
        assert not problems, problems
    target = {k: torch.empty_like(v) for k, v in sd.items()}
    for key, verify_first in (("load_cold_s", False), ("verify_then_load_s", True)):
        drop_cache(plain)  # a load with verification: the verify reads the disk, the load then the page cache
        sync(device)
        t0 = time.perf_counter()
        if verify_first:
            assert not integrity.verify(plain, sizes, sums, threads=load_threads)
        with quiet_dcp():
            dcp.load(target, storage_reader=FileSystemReader(plain), no_dist=True)
        sync(device)
        out[key] = time.perf_counter() - t0
    del target
    shutil.rmtree(plain)

    for mode, key in (("disabled", "save_with_checksums_s"), ("async", "async")):
        sub = os.path.join(folder, mode)
        cfg = Checkpoint(enable=True, async_mode=mode, io_threads=args.io_threads, interval=1)
        manager = CheckpointManager(cfg, sub, model=module)
        sync(device)
        manager.save(1)
        manager.close()
        stats = manager.stats[-1]
        if mode == "disabled":
            out[key] = stats["write_s"]
        else:
            out["async_stall_s"], out["async_total_s"] = stats["stall_s"], stats["write_s"]
        out[f"{mode}_checksum_s"] = stats["checksum_s"]
        shutil.rmtree(sub)

    for key in ("save", "checksum", "verify_warm", "verify_cold", "load_cold"):
        out[f"{key}_gbps"] = gb / max(out[f"{key}_s"], 1e-9)
    out["checksum_vs_save"] = out["checksum_s"] / out["save_s"]
    out["verify_vs_load"] = out["verify_then_load_s"] / out["load_cold_s"] - 1
    out.update(hash_speeds())
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=16.0, help="state size in GiB (<= 32 fits the 64 GiB disk)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "ckpt_bench"),
                   help="scratch folder (default: ckpt_bench in the system's temp folder), deleted at the end")
    p.add_argument("--io-threads", type=int, default=1, help="DCP writer threads (checkpoint.io_threads)")
    args = p.parse_args(argv)
    if os.path.exists(args.folder):
        print(f"error: {args.folder} exists; pick an empty --folder (it is deleted at the end)", file=sys.stderr)
        return 2
    try:
        result = run(args, args.folder)
    finally:
        shutil.rmtree(args.folder, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
