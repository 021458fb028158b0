"""Side-by-side throughput: titanlike and (optionally) the peer, torchtitan, on the same shape in one run.

    python scripts/benchmark.py --nproc 2 --steps 20 --flavor 8B --seq 8192 --batch 1 --ac selective \
        --compile --peer .peer/peer_torchtitan.sh --out $OUT/bench.json

Both use the Llama 3 vocabulary size (128,256) and small local corpora (titanlike: the stdlib text with its builtin
tokenizer; the peer: its synthetic word corpus), so the loss falls in both, and log every step; the
first `--warmup` steps (compilation, allocator warm-up) are dropped and the median of the rest is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = re.compile(r"step\s+(\d+)\s+loss\s+([\d.naif]+).*?tok/s\s+([\d,]+)(?:.*?mfu\s+([\d.]+)%)?(?:.*?mem ([\d.]+)GiB)?")
PEER = re.compile(r"step:\s*(\d+).*?loss:\s*([\d.]+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")
PEER_FLAVOR = {"1B": "1B", "8B": "8B", "8B_4L": "8B_4L", "debugmodel": "debugmodel"}


def run(cmd: list[str], env: dict, log_path: str | None) -> str:
    t0 = time.time()
    p = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log_path:
        with open(log_path, "w") as f:
            f.write(p.stdout)
    print(f"$ {' '.join(cmd)}\n  exit {p.returncode} in {time.time() - t0:.0f}s", flush=True)
    if p.returncode != 0:
        print(p.stdout[-4000:], flush=True)
    return p.stdout


def summarize(rows: list[dict], warmup: int) -> dict:
    kept = [r for r in rows if r["step"] > warmup] or rows
    if not kept:
        return {}
    out = {k: statistics.median(r[k] for r in kept if r.get(k) is not None)
           for k in ("tps", "mfu", "mem") if any(r.get(k) is not None for r in kept)}
    out["loss_first"], out["loss_last"], out["steps"] = rows[0]["loss"], rows[-1]["loss"], len(kept)
    return out


def ours(a, env) -> dict:
    ac_mode = "none" if a.ac == "none" else ("full" if a.ac == "full" else "selective")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
           "scripts/train.py", "--config", a.config, f"--model.flavor={a.flavor}", "--model.vocab_size=128256",
           f"--data.dataset={a.data}", f"--training.seq_len={a.seq}", f"--training.local_batch_size={a.batch}",
           f"--training.steps={a.steps}", "--lr_scheduler.warmup_steps=2", "--metrics.log_freq=1",
           f"--activation_checkpoint.mode={ac_mode}", f"--activation_checkpoint.selective_option={a.ac_option}", f"--compile.enable={str(a.compile).lower()}",
           "--checkpoint.enable=false", "--metrics.enable_tensorboard=false", *a.extra]
    text = run(cmd, env, a.log and a.log + ".titanlike.log")
    rows = []
    for m in OURS.finditer(text):
        rows.append({"step": int(m[1]), "loss": float(m[2]), "tps": float(m[3].replace(",", "")),
                     "mfu": float(m[4]) if m[4] else None, "mem": float(m[5]) if m[5] else None})
    return summarize(rows, a.warmup)


def peer(a, env) -> dict:
    args = ["bash", a.peer, PEER_FLAVOR[a.flavor], "--training.seq_len", str(a.seq),
            "--training.local_batch_size", str(a.batch), "--training.steps", str(a.steps),
            "--activation_checkpoint.mode", a.ac, "--activation_checkpoint.selective_ac_option", a.ac_option]
    if a.compile:
        args.append("--compile.enable")
    text = run(args, {**env, "NPROC": str(a.nproc)}, a.log and a.log + ".peer.log")
    rows = [{"step": int(m[1]), "loss": float(m[2]), "mem": float(m[3]), "tps": float(m[4].replace(",", "")),
             "mfu": float(m[5])} for m in PEER.finditer(text)]
    return summarize(rows, a.warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/llama3_1b.toml")
    p.add_argument("--flavor", default="1B")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from the median")
    p.add_argument("--ac", default="none", choices=["none", "full", "selective"])
    p.add_argument("--ac-option", default="2", help="selective AC: 'op' or every N-th block (the peer's default: 2)")
    p.add_argument("--data", default="stdlib", help="titanlike dataset: stdlib (real text, the loss falls) or mock")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--peer", default="", help="path to peer_torchtitan.sh; empty = titanlike only")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--log", default="", help="prefix for the full logs")
    p.add_argument("extra", nargs="*", help="extra --section.key=value for titanlike (after --)")
    a = p.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = {"shape": vars(a), "titanlike": ours(a, env)}
    if a.peer:
        result["peer"] = peer(a, env)
    print(f"\n{'':10} {'tok/s/dev':>10} {'MFU %':>7} {'mem GiB':>8} {'loss first→last':>18}")
    for name in ("titanlike", "peer"):
        r = result.get(name)
        if r:
            print(f"{name:10} {r.get('tps', 0):10,.0f} {r.get('mfu') or 0:7.1f} {r.get('mem') or 0:8.1f} "
                  f"{r['loss_first']:8.3f} → {r['loss_last']:.3f}")
    if result.get("peer") and result["titanlike"].get("tps") and result["peer"].get("tps"):
        result["ratio"] = result["titanlike"]["tps"] / result["peer"]["tps"]
        print(f"titanlike / peer tokens/s: {result['ratio']:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
