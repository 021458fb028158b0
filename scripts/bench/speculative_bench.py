"""Speculative decoding with the MTP modules, measured on a model that learned something: train a decoder with MTP on
the stdlib text through scripts/train.py, then decode held-out stdlib prompts with plain greedy generate() and with
mtp_generate() (titanlike/infer/speculative.py) at each draft depth, on the same device; report the acceptance rate,
the tokens per main-model forward, tokens/s and the speed-up, and whether the tokens are identical.

    python scripts/bench/speculative_bench.py --out results/speculative.json        # GPU: ~94M decoder, bf16
    python scripts/bench/speculative_bench.py --tiny --out /tmp/spec.json            # CPU smoke run (seconds)
    python scripts/bench/speculative_bench.py --workdir /tmp/spec --decode-only      # decode again, no training

Why train: with random weights the MTP drafts are always rejected, so acceptance and speed-up say nothing. The run
trains `--steps` steps (eager, bf16 FSDP on one GPU) and writes a model-only export; the prompts are windows of the
stdlib corpus's held-out tail (the training run's "valid" split, never trained on). Decoding is eager (mtp_generate
runs eager); `--compile-plain` adds plain generate's compiled decode step as a further baseline (it compiles per
batch shape: tens of seconds each). Timing: a short warm-up call per engine and batch shape, then one timed pass;
"batch 1" decodes the first --single prompts one at a time (times and statistics summed), "batch B" all --prompts
prompts in one left-padded call. Rows run to --new-tokens (no EOS stop), so every engine decodes the same tokens.

Exactness: speculative greedy equals plain greedy in exact arithmetic. In bf16 the verify forward over k+1 tokens
may round differently from the one-token decode step (other GEMM shapes), so a near-tie can flip: the table shows the
rows that agree and where the first difference is, and `--check-fp32` (default on a GPU) repeats the batched
comparison in float32, where they should agree. Bad input: one line, exit 2; a failed training run: its log's tail,
exit 1.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

# (GPU, --tiny) defaults. GPU: dim 768 x 12 layers + 2 MTP modules (~94M parameters with the builtin 2048-token
# vocabulary): 600 steps of 16 x 1024 tokens (~10M tokens, ~2.5 passes over the corpus) train in about a minute eager
# on one H100 (an estimate, not measured). A guess at what it buys: a 6M model trained on 0.6M tokens on a CPU had
# about half its depth-1 drafts right (docs/mtp.md). Tiny: what 2 CPU cores train in seconds; its drafts are mostly
# accepted only because its output repeats one token (the report's sample shows it).
DEFAULTS = {
    False: dict(dim=768, layers=12, heads=12, kv_heads=4, depth=2, seq=1024, batch=16, steps=600, lr=1e-3,
                warmup=50, prompt_len=128, new_tokens=128, prompts=4, single=4),
    True: dict(dim=64, layers=2, heads=4, kv_heads=2, depth=2, seq=64, batch=8, steps=30, lr=3e-3, warmup=5,
               prompt_len=16, new_tokens=16, prompts=3, single=2),
}


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: a 2-layer dim-64 decoder, fp32, seconds")
    p.add_argument("--model", default=models.DEFAULT_MODEL, help="a family with MTP modules; the shape flags below "
                   "are its args dim, n_heads, n_kv_heads (the default family's names)")
    p.add_argument("--flavor", default="debugmodel", help="the flavor the shape flags change")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--workdir", default=None, help="train into this folder and keep it (default: a temporary "
                   "folder, removed at the end)")
    p.add_argument("--decode-only", action="store_true", help="skip training: decode with the run in --workdir")
    for key, kind, what in (("dim", int, "model width"), ("layers", int, "decoder layers"),
                            ("heads", int, "attention heads"), ("kv-heads", int, "KV heads"),
                            ("depth", int, "MTP modules (model.args.mtp_num_layers); every draft depth 1..depth is "
                             "measured"),
                            ("seq", int, "training sequence length"), ("batch", int, "training batch"),
                            ("steps", int, "training steps"), ("lr", float, "peak learning rate"),
                            ("warmup", int, "warm-up steps"), ("prompt-len", int, "prompt tokens"),
                            ("new-tokens", int, "tokens generated per row"),
                            ("prompts", int, "prompts, and the batch of the batched run"),
                            ("single", int, "of those, how many are decoded alone (the batch-1 run)")):
        p.add_argument(f"--{key}", type=kind, default=None, help=f"{what} (default: see DEFAULTS)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="decoding dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--check-fp32", choices=("auto", "on", "off"), default="auto",
                   help="repeat the batched comparison in float32 (auto: when decoding in bfloat16)")
    p.add_argument("--iters", type=int, default=1, help="timed passes per engine and batch (the best is shown)")
    p.add_argument("--compile-plain", action="store_true", help="also time plain generate --compile")
    p.add_argument("--train-timeout", type=float, default=300.0, help="seconds before the training run is stopped")
    p.add_argument("--train-extra", action="append", default=[], help="one more scripts/train.py flag (repeatable), "
                   "e.g. --train-extra=--compile.enable=true")
    a = p.parse_args(argv)
    for key, value in DEFAULTS[a.tiny].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    return a


def _check(a) -> None:
    for key in ("iters", "dim", "layers", "heads", "kv_heads", "depth", "seq", "batch", "steps", "prompt_len",
                "new_tokens", "prompts", "single"):
        if getattr(a, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')}={getattr(a, key)} must be at least 1")
    if a.single > a.prompts:
        raise ValueError(f"--single={a.single} exceeds --prompts={a.prompts}: the batch-1 run decodes some of them")
    if a.prompt_len + a.new_tokens > a.seq and not a.decode_only:  # else: checked against the loaded model
        raise ValueError(f"--prompt-len {a.prompt_len} + --new-tokens {a.new_tokens} exceeds --seq {a.seq}, the "
                         f"trained model's context: lower them or raise --seq")
    if a.decode_only and not a.workdir:
        raise ValueError("--decode-only decodes an earlier run: give its --workdir")
    if a.workdir and not a.decode_only and os.path.exists(os.path.join(a.workdir, "run")):
        raise ValueError(f"{os.path.join(a.workdir, 'run')} holds an earlier run: decode it with --decode-only, or "
                         f"give another --workdir")


def train(a, run_dir: str) -> dict:
    """scripts/train.py on the stdlib with MTP; the final step written as a model-only export. Its output streams
    through (so progress shows), the last step line is kept for the report."""
    config = "configs/debug_model.toml" if a.tiny else "configs/base_gpu.toml"
    shape = (f"{{dim = {a.dim}, n_heads = {a.heads}, n_kv_heads = {a.kv_heads}, mtp_num_layers = {a.depth}}}")
    cmd = [sys.executable, os.path.join(ROOT, "scripts/train.py"), "--config", config, f"--model.name={a.model}",
           f"--model.flavor={a.flavor}", f"--model.n_layers={a.layers}", f"--model.args={shape}",
           "--data.dataset=stdlib", "--data.tokenizer=builtin",
           f"--training.steps={a.steps}", f"--training.seq_len={a.seq}", f"--training.local_batch_size={a.batch}",
           "--training.global_batch_size=-1", f"--training.device={'cpu' if a.tiny else 'cuda'}",
           f"--optimizer.lr={a.lr}", f"--lr_scheduler.warmup_steps={a.warmup}", "--lr_scheduler.decay_type=cosine",
           # eager: a cold compile costs ~20 s on a fresh node, about what it would save in a one-minute run
           "--compile.enable=false", "--validation.enable=false", "--metrics.enable_tensorboard=false",
           f"--metrics.log_freq={max(1, a.steps // 10)}",
           "--checkpoint.enable=true", f"--checkpoint.interval={a.steps}", "--checkpoint.async_mode=disabled",
           "--checkpoint.last_save_model_only=true",
           f"--job.dump_folder={os.path.dirname(run_dir)}", f"--job.run_name={os.path.basename(run_dir)}",
           *a.train_extra]
    print("$ " + " ".join(cmd), flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # own group: a timeout takes the whole run down
    timer = threading.Timer(a.train_timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()

    def stop(signum, frame):  # an outer `timeout` or Ctrl-C: the run in its own session would keep the GPU
        raise SystemExit(128 + signum)
    old = signal.signal(signal.SIGTERM, stop)
    last_step = ""
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            if " loss " in line and "step" in line:
                last_step = line.strip()
        rc = proc.wait()
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, old)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.perf_counter() - t0
    if rc != 0:
        killed = rc in (-signal.SIGKILL, 128 + signal.SIGKILL)
        why = f"stopped after --train-timeout={a.train_timeout:.0f} s" if killed else f"exit status {rc}"
        raise SystemExit(f"error: the training run failed ({why}); its last lines are above")
    return {"seconds": round(seconds, 1), "last_step_line": last_step, "command": cmd[1:]}


def held_out_prompts(loaded, n: int, length: int) -> list[list[int]]:
    """n windows of `length` tokens spread over the corpus's held-out tail: the "valid" split the training run
    computed for its seq_len (the model's max_seq_len), so no prompt token was trained on."""
    from titanlike.data.dataset import build_dataset

    if loaded.tokenizer is None or loaded.data is None or loaded.data.dataset != "stdlib":
        raise ValueError(f"{loaded.source}: not a stdlib run with its tokenizer; train one with this script")
    valid = build_dataset(loaded.data, loaded.tokenizer, seq_len=loaded.max_seq_len, split="valid")
    tokens = valid.tokens[valid.start:valid.stop]
    stride = (len(tokens) - length) // max(1, n - 1) if n > 1 else 0
    if len(tokens) < length or (n > 1 and stride < 1):
        raise ValueError(f"the held-out tail has {len(tokens)} tokens: too few for {n} prompts of {length}")
    return [tokens[i * stride:i * stride + length].astype("int64").tolist() for i in range(n)]


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def _engines(model, depth: int, compile_plain: bool):
    """(name, draft depth or 0, call(prompts, new_tokens) -> (tokens, SpeculativeStats or None)); plain eager first:
    the reference every other engine is compared with."""
    from titanlike.infer import generate
    from titanlike.infer.speculative import mtp_generate

    out = [("greedy eager", 0, lambda p, n: (generate(model, p, max_new_tokens=n), None))]
    if compile_plain:
        out.append(("greedy --compile", 0, lambda p, n: (generate(model, p, max_new_tokens=n, compile=True), None)))
    for k in range(1, depth + 1):
        out.append((f"mtp draft {k}", k, lambda p, n, k=k: mtp_generate(model, p, max_new_tokens=n, draft_tokens=k)))
    return out


def _agreement(outs: list[list[int]], ref: list[list[int]]) -> dict:
    same = sum(o == r for o, r in zip(outs, ref))
    firsts = [next((i for i, (x, y) in enumerate(zip(o, r)) if x != y), min(len(o), len(r)))
              for o, r in zip(outs, ref) if o != r]
    return {"identical": same == len(ref), "rows_identical": same, "rows": len(ref),
            "first_divergence": min(firsts) if firsts else None}


def run_group(engines, calls: list[list[list[int]]], new_tokens: int, device, iters: int = 1,
              timed: bool = True) -> tuple[list[dict], list[list[int]]]:
    """Every engine over the same calls (lists of prompts): seconds (the best of `iters` passes), tokens/s, the summed
    speculative statistics and the agreement with the first engine's tokens; and those reference tokens."""
    from titanlike.infer.speculative import SpeculativeStats

    rows, ref, base = [], None, {}
    for name, k, call in engines:
        if timed:  # first-call costs (allocator, cuBLAS handles; the compiled step: its compilation) stay out
            call(calls[0], new_tokens if "compile" in name else min(8, new_tokens))
        best = float("inf")
        for _ in range(iters):  # each pass decodes the same tokens: the statistics are the last pass's
            outs, seconds, total = [], 0.0, SpeculativeStats()
            for prompts in calls:
                _sync(device)
                t0 = time.perf_counter()
                out, stats = call(prompts, new_tokens)
                _sync(device)
                seconds += time.perf_counter() - t0
                outs += out
                if stats is not None:
                    for f in ("drafted", "accepted", "matched", "rounds", "committed", "row_forwards",
                              "rows_drafted", "rows_accepted"):  # the lists concatenate: one entry per prompt
                        setattr(total, f, getattr(total, f) + getattr(stats, f))
            best = min(best, seconds)
        seconds = best
        tokens = sum(map(len, outs))
        row = {"batch": len(calls[0]), "engine": name, "draft_tokens": k, "calls": len(calls),
               "new_tokens": tokens, "seconds": round(seconds, 4), "tok_s": round(tokens / seconds, 1)}
        if k:
            forwards = total.rounds + len(calls)  # the verify rounds and each call's prefill
            # match_rate: drafts each row's main model agreed with; acceptance_rate: those committed (each row
            # commits its own; they differ only where max_new_tokens cut a round). tokens_per_main_forward: what a
            # live row commits per main forward, prefill included
            row.update(drafted=total.drafted, accepted=total.accepted, matched=total.matched,
                       acceptance_rate=round(total.acceptance_rate, 4), match_rate=round(total.match_rate, 4),
                       rows_acceptance=[round(a / d, 4) if d else 0.0
                                        for a, d in zip(total.rows_accepted, total.rows_drafted)],
                       main_forwards=forwards, tokens_per_main_forward=round(total.tokens_per_forward, 3))
        else:
            row.update(main_forwards=tokens // len(calls[0]), tokens_per_main_forward=1.0)
        if ref is None:
            ref = outs
        row.update(_agreement(outs, ref))
        base.setdefault(name.split(" ")[0] + (" compile" if "compile" in name else ""), row["tok_s"])
        row["speedup"] = round(row["tok_s"] / base["greedy"], 3)
        if "greedy compile" in base:
            row["speedup_vs_compiled"] = round(row["tok_s"] / base["greedy compile"], 3)
        rows.append(row)
    return rows, ref


def decode(a, run_dir: str, device) -> dict:
    import torch

    from titanlike.infer.load import load_for_inference

    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    loaded = load_for_inference(run_dir, device=device, dtype=dtype)
    model, depth = loaded.model, len(getattr(loaded.model, "mtp", None) or [])
    if depth == 0:
        raise ValueError(f"{loaded.source}: the model has no MTP modules (trained without model.args.mtp_num_layers)")
    if a.prompt_len + a.new_tokens > loaded.max_seq_len:
        raise ValueError(f"--prompt-len {a.prompt_len} + --new-tokens {a.new_tokens} exceeds the model's context of "
                         f"{loaded.max_seq_len} tokens")
    prompts = held_out_prompts(loaded, a.prompts, a.prompt_len)
    groups = [[[p] for p in prompts[:a.single]], [prompts]]
    engines = _engines(model, depth, a.compile_plain)
    runs, ref = [], None
    for calls in groups:
        rows, ref = run_group(engines, calls, a.new_tokens, device, a.iters)
        runs += rows
    # what the drafts were asked to predict: a degenerate model (one token repeated) is accepted almost always
    sample = {"prompt": loaded.tokenizer.decode(prompts[0])[-120:], "greedy": loaded.tokenizer.decode(ref[0])[:240],
              "distinct_tokens": len(set(ref[0])), "tokens": len(ref[0])}
    report = {"model": loaded.spec.name, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "dtype": str(dtype).removeprefix("torch."), "source": loaded.source, "step": loaded.step,
              "params": sum(p.numel() for p in model.parameters()), "mtp_depth": depth,
              "model_args": {k: getattr(loaded.args, k) for k in ("dim", "n_layers", "n_heads", "n_kv_heads",
                                                                    "vocab_size", "max_seq_len")},
              "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "prompts": a.prompts, "runs": runs,
              "sample": sample}
    if a.check_fp32 == "on" or (a.check_fp32 == "auto" and dtype != torch.float32):
        del model, loaded, engines
        fp32 = load_for_inference(run_dir, device=device, dtype=torch.float32).model
        rows = run_group(_engines(fp32, depth, False), [prompts], a.new_tokens, device, timed=False)[0]
        report["fp32_check"] = [{k: r[k] for k in ("batch", "engine", "identical", "rows_identical", "rows",
                                                     "first_divergence")} for r in rows]
    return report


def table(report: dict) -> str:
    lines = [f"{report['device']}, {report['dtype']}, torch {report['torch']}: {report['model']} "
             f"{report['params'] / 1e6:.1f}M params with {report['mtp_depth']} MTP modules, step {report['step']}; "
             f"{report['prompts']} held-out stdlib prompts of {report['prompt_len']} tokens, "
             f"{report['new_tokens']} new tokens each, greedy",
             f"{'batch':>5}  {'engine':<17} {'seconds':>8} {'new tok/s':>10} {'speed-up':>8} {'accepted':>9} "
             f"{'matched':>8} {'tok/fwd':>7}  identical"]
    for r in report["runs"]:
        acc = f"{100 * r['acceptance_rate']:.1f}%" if r["draft_tokens"] else "-"
        match = f"{100 * r['match_rate']:.1f}%" if r["draft_tokens"] else "-"
        same = f"{r['rows_identical']}/{r['rows']}" + ("" if r["identical"] else
                                                      f" (first difference at token {r['first_divergence']})")
        lines.append(f"{r['batch']:>5}  {r['engine']:<17} {r['seconds']:>8.3f} {r['tok_s']:>10.1f} "
                     f"{r['speedup']:>7.2f}x {acc:>9} {match:>8} {r['tokens_per_main_forward']:>7.2f}  {same}")
    sample = report["sample"]
    lines.append(f"row 0 of plain greedy ({sample['distinct_tokens']} distinct of {sample['tokens']} tokens): "
                 f"{sample['greedy'][:100]!r}")
    for r in report.get("fp32_check", []):
        lines.append(f"float32 check, batch {r['batch']}, {r['engine']}: {r['rows_identical']}/{r['rows']} rows "
                     f"identical to plain greedy" + ("" if r["identical"] else
                                                     f" (first difference at token {r['first_divergence']})"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    try:
        _check(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    from titanlike.checkpoint.layout import CheckpointError

    if not a.tiny and not torch.cuda.is_available():
        print("error: speculative_bench.py measures on a GPU and found no CUDA device: run it with --tiny on a CPU",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if a.tiny else "cuda")
    workdir = os.path.abspath(a.workdir or tempfile.mkdtemp(prefix="specbench-"))
    run_dir = os.path.join(workdir, "run")
    try:
        trained = None if a.decode_only else train(a, run_dir)
        report = decode(a, run_dir, device)
    except (ValueError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if not a.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report["train"] = trained
    print(table(report))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
