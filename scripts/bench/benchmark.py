"""Throughput matrix: titanlike and (optionally) the peer, torchtitan, on the same shapes in one run.

    python scripts/bench/benchmark.py --flavor 1B --seq 4096 --batch 2 --compile on --float8 none,tensorwise \
        --peer auto --out results/bench.json
    python scripts/bench/benchmark.py --matrix bench.toml --out results/bench.json   # cases from a TOML file
    python scripts/bench/benchmark.py --model bert --flavor bert-large --seq 512 --batch 16 --data mock \
        --compile on --peer hf --out results/bert.json                       # BERT and T5: see below

The peer's launcher is scripts/bench/peer_torchtitan.sh (`--peer auto` names the one in this checkout; it needs
torchtitan 0.2.2's wheels, see docs/benchmarks.md "How to reproduce"); --peer takes any other launcher's path too,
called as `bash PATH FLAVOR [torchtitan flags]` with NPROC set; without --peer, titanlike runs alone. `--only
titanlike` / `--only peer` runs one side with exactly the flags the pair would get: for a case whose cold first steps
need a machine call each (the two halves' JSONs then compare as one run would).

Every axis option takes a comma-separated list; the matrix is their product. A TOML matrix has an optional
`[defaults]` table and `[[case]]` tables (axis = value or list; lists expand). Precedence: built-in defaults <
[defaults] < command line < each [[case]].
Axes: flavor, seq, batch, nproc, compile (on/off), float8 (none | tensorwise | rowwise | rowwise_with_gw_hp, each
optionally with "+experts": float8.moe_experts, the MoE's routed experts on the float8 grouped GEMM too; no peer run),
float8_all_gather (on/off: tensorwise under FSDP only, with precomputed scales), ac (none | full | selective |
memory_budget), ac_option ("op" or N for selective; the budget in [0, 1] for memory_budget), layout (degrees as
tp=2:pp=2; dp_shard fills the rest), loss_chunk (titanlike only: training.loss_chunk_tokens), config (titanlike
TOML; default by flavor), post ("" pretraining; sft | lora | dpo: the post-training cases, see below), dec_seq (t5's
decoder length, see below).

Post-training (issue 36): `--peer trl --post sft,lora,dpo` (or `--peer trl-sft` etc.) runs titanlike with chat data
(packed, document masking), the same plus [lora], or preference pairs packed into rows (data.preference_layout=pack,
document masking), against TRL's SFTTrainer / + PEFT / DPOTrainer (scripts/bench/peer_trl.py) on the same records and
tokenizer (scripts/bench/post_training_data.py, written into --post-data once). DPO is compared in pairs per second:
titanlike's from its step lines (pairs/s: the pairs its packed rows held over the time), the peer's as batch pairs per
step time (its step time from its tok/s over 2·batch·seq tokens per step); --batch is rows of seq tokens for
titanlike, pairs for TRL (which pads each batch to its longest sequence), so the two steps hold different pair counts.
In the JSON as pairs_s, the ratio of the two as ratio. SFT/LoRA: the peer counts the real tokens of its padding-free
batches, titanlike whole packed rows, so the ratio scales titanlike's tok/s by its pack fill (the share of row tokens
that are conversation tokens, from its start-up log; in the JSON as pack_fill).

BERT and T5 (`--model bert` / `--model t5 --peer hf`): the peer is transformers' BertForPreTraining (MLM + NSP
labels) / T5ForConditionalGeneration, compiled, bf16, fused AdamW, on random tokens of the same shape
(scripts/bench/peer_hf.py); titanlike should read `--data mock` (random tokens: its objective draws BERT's masks and
T5's spans from plain rows, nothing to download). No config given: configs/base_gpu.toml (one GPU, compiled, bf16)
with --model.name. --vocab defaults to the flavor's (30522, 32128; --vocab 30592 for Megatron's padded BERT table).
`--dec-seq N` (t5 only) sets the decoder length on both sides: titanlike's model.args.decoder_multiple = N (its span
objective pads every row's decoder to it; data.decoder_seq_length = N too, for Megatron's T5 data) and the peer's
`--decoder-len N`; without it both take the span objective's length from seq (104 at 512, padded to 8). Tokens per
step, both sides: batch x seq, the encoder's tokens for T5 (what titanlike's loader counts); FLOPs per token:
titanlike's count (models/<family>/counts.py) at the same args, for both (T5: per encoder token with the decoder's
share at its length). On plain rows titanlike's BERT has no binary head (refused without sentence-pair labels), so
the peer also runs a pooler and a 2-way classifier per row, uncounted (under 0.1% of the FLOPs).

ViT and LLaVA (`--model vit --peer timm`, `--model llava --peer hf`): timm's vit_large_patch16_224 and transformers'
LlavaForConditionalGeneration on random inputs of the same shape; titanlike on configs/vit_l16.toml /
configs/llava_1b.toml (debug flavors: their debug configs) with mock images, JPEG shards (--data jpeg) or, for vit,
procedural shapes. Units: images/s for vit, decoder tokens/s (--seq per row: text + placeholders) for llava, with
`--images K` images per row; titanlike's log line also gives the loader's share of the step (data%). See
scripts/bench/bench_vision.py.

Each run logs every step (--log-freq N: every N-th, as a default training config does; a log line's tok/s then
covers its N steps, for both); the first --warmup steps (compilation, allocator warm-up) are dropped and medians of the
rest are reported: tokens/s per device, MFU (over the dense bf16 peak), TFLOP/s per device (model FLOPs: 6·N +
12·L·d·seq per token, the same for both), peak reserved memory, time of the first step (compile time: a cold start,
each framework and case on its own empty Inductor/Triton caches, unless --compile-cache shared; with --warm also the
first step of a 3-step rerun on the caches the cold run left), median step time
and its spread (p90 - p10 over the median). Data: titanlike reads --data (stdlib text or mock tokens), the peer its
synthetic word corpus; both use one vocabulary size (--vocab), so compute per token is identical. Peer float8 flags
(torchtitan 0.2.2): --model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output, then for
tensorwise under FSDP --quantize.linear.float8.enable_fsdp_float8_all_gather and
--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp (recipe_name must stay unset: torchtitan refuses
it together with the all-gather), for rowwise* --quantize.linear.float8.recipe_name NAME.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
from bench_proc import environment, run, stop_runs  # the runs themselves: processes, their environment
from peer_torchtitan import PEER_FLAVORS  # what the peer launcher can run, per model
from bench_report import (compare_to_bf16, format_table, pack_fill, parse_ours, parse_peer,
                          summarize)
import bench_vision as vision  # vit against timm, llava against transformers: units, data, peers
from bench_matrix import (AXES, ENCODER_MODELS, encoder_flags, expand_matrix, float8_experts, float8_recipe, label,
                          on_off, parse_layout, peer_ac, vocab_of)

PEER_LAUNCHER = os.path.join(ROOT, "scripts", "bench", "peer_torchtitan.sh")
PEER_HF = os.path.join(ROOT, "scripts", "bench", "peer_hf.py")  # the hybrids' peer: transformers + fla (--peer hf)
# titanlike's start-up line of packed chat data (titanlike/data/sft.py): its tok/s counts whole rows, padding included
PEER_TRL = os.path.join(ROOT, "scripts", "bench", "peer_trl.py")  # post-training's peer: TRL (--peer trl)
PEER_TIMM = os.path.join(ROOT, "scripts", "bench", "peer_timm.py")  # vit's peer: timm (--peer timm)
# titanlike's data flags for each post-training case ({d}: the folder of post_training_data.py): SFT packs whole
# conversations with document masking, as TRL's padding-free "bfd" packing does; LoRA is SFT with [lora] on.
SFT_FLAGS = ["--data.dataset=chat", "--data.paths={d}/chat.jsonl", "--data.sft_layout=pack",
             "--data.document_masking=true", "--data.reset_position_ids=true"]
# DPO packs whole pairs into rows the same way (TRL's DPOTrainer pads each batch to its longest pair instead).
POST_FLAGS = {"sft": SFT_FLAGS, "lora": [*SFT_FLAGS, "--lora.enable=true"],
              "dpo": ["--data.dataset=preference", "--data.paths={d}/pairs.jsonl", "--data.preference_layout=pack",
                      "--data.document_masking=true", "--data.reset_position_ids=true"]}

def default_config(model: str, flavor: str) -> str:
    """The shipped config for a flavor: configs/<model>_<flavor>.toml when it exists (e.g. the 1B's), the debug
    config for the debug flavor, else configs/base_gpu.toml with --model.flavor. BERT and T5: configs/<model>_debug.toml
    for their debug flavors, else configs/base_gpu.toml (one GPU)."""
    if model in vision.VISION_MODELS:
        return vision.default_config(model, flavor)
    if model in ENCODER_MODELS and flavor.startswith("debugmodel"):
        return f"configs/{model}_debug.toml"
    if flavor == "debugmodel":
        return "configs/debug_model.toml"
    path = f"configs/{model}_{flavor.lower()}.toml"
    return path if os.path.isfile(os.path.join(ROOT, path)) else "configs/base_gpu.toml"
PEER_DEGREE = {"dp_replicate": "data_parallel_replicate_degree", "dp_shard": "data_parallel_shard_degree",
               "tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree", "cp": "context_parallel_degree",
               "ep": "expert_parallel_degree"}


def _fsdp_applies(case: dict) -> bool:
    degrees = parse_layout(case["layout"])
    others = 1
    for k in ("dp_replicate", "tp", "pp", "cp"):
        others *= degrees.get(k, 1)
    shard = degrees.get("dp_shard", -1)
    shard = case["nproc"] // others if shard == -1 else shard
    return shard * degrees.get("cp", 1) > 1 or degrees.get("dp_replicate", 1) > 1


def _fp8_all_gather(case: dict) -> bool:
    return float8_recipe(case["float8"]) == "tensorwise" and case["float8_all_gather"] and _fsdp_applies(case)


def _ac_option_flags(ac: str, option: str, prefix: str, sep: str, selective_key: str = "selective_option") -> list[str]:
    """ac_option as the flag its mode reads: the budget for memory_budget, else the selective option."""
    key = "memory_budget" if ac == "memory_budget" else selective_key
    return [f"{prefix}{key}={option}"] if sep == "=" else [f"{prefix}{key}", option]


def resolve_peer(peer: str) -> str:
    """--peer's value as a launcher path: "auto" is this checkout's peer_torchtitan.sh, "hf" its peer_hf.py (the
    hybrids' peer: transformers with flash-linear-attention's kernels), "trl" its peer_trl.py (post-training cases);
    "" stays "" (no peer)."""
    return {"auto": PEER_LAUNCHER, "hf": PEER_HF, "trl": PEER_TRL, "timm": PEER_TIMM}.get(peer, peer)


def tokens_per_step(case: dict, peer: bool = False) -> int:
    """Tokens each device is credited with per step (both frameworks divide by the model-parallel size: TP/PP/CP ranks
    of one data-parallel group share the same tokens). DPO: titanlike's batch is packed rows of seq tokens, TRL's
    (peer) is pairs, two sequences of seq each as peer_trl.py counts them."""
    degrees = parse_layout(case["layout"])
    sharing = degrees.get("tp", 1) * degrees.get("pp", 1) * degrees.get("cp", 1)  # ranks sharing one batch
    if case["model"] in vision.VISION_MODELS:  # images (vit) or decoder tokens (llava): bench_vision.py
        return case["batch"] * vision.units_per_row(case) // max(1, sharing)
    return case["batch"] * case["seq"] * (2 if peer and case["post"] == "dpo" else 1) // max(1, sharing)


def post_training_ratio(case: dict, ours: dict, peer: dict) -> dict:
    """{"ratio": titanlike over the peer} where both measured: DPO in pairs per second, the rest in tok/s
    (titanlike's scaled by its pack fill for SFT/LoRA, see the module doc); {} otherwise."""
    key = "pairs_s" if case["post"] == "dpo" else "tps"
    if not (ours.get(key) and peer.get(key)):
        return {}
    return {"ratio": ours[key] * (1.0 if key == "pairs_s" else ours.get("pack_fill", 1.0)) / peer[key]}


def titanlike_cmd(case: dict, opts) -> list[str]:
    train = ["scripts/train.py"]
    if case["nproc"] > 1:
        train = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={case['nproc']}", *train]
    config = case["config"] or default_config(case["model"], case["flavor"])
    data = [f"--data.dataset={opts.data}"]
    seq = case["seq"]
    if case["model"] in vision.VISION_MODELS:  # their rows hold pixel bytes: length, data and shape flags
        data, seq = vision.data_flags(case, opts), vision.row_len(case)
    if case["post"]:  # the inputs the peer reads too: one tokenizer (its template in its folder), the same records
        data = [f.format(d=opts.post_data) for f in POST_FLAGS[case["post"]]] + [
            f"--data.tokenizer={opts.post_data}/tokenizer"]
    cmd = [sys.executable, *train, "--config", config, f"--model.name={case['model']}",
           f"--model.flavor={case['flavor']}", f"--model.vocab_size={vocab_of(case, opts)}", *data,
           *encoder_flags(case, opts.data),
           f"--training.seq_len={seq}",
           f"--training.local_batch_size={case['batch']}", "--training.global_batch_size=-1",
           f"--training.steps={opts.steps}", "--lr_scheduler.warmup_steps=2", f"--metrics.log_freq={opts.log_freq}",
           f"--activation_checkpoint.mode={case['ac']}",
           *_ac_option_flags(case["ac"], case["ac_option"], "--activation_checkpoint.", "="),
           f"--compile.enable={str(case['compile']).lower()}", f"--training.loss_chunk_tokens={case['loss_chunk']}",
           "--checkpoint.enable=false", "--metrics.enable_tensorboard=false", f"--job.dump_folder={opts.dump_folder}",
           # one run folder per case, so profiler traces (-- --profiling.enable_profiling=true) don't overwrite
           "--job.run_name=" + re.sub(r"[^A-Za-z0-9_.-]+", "_", label(case))]
    cmd += [f"--parallelism.{k}={v}" for k, v in parse_layout(case["layout"]).items()]
    if case["float8"] != "none":
        cmd += ["--float8.enable=true", f"--float8.recipe={float8_recipe(case['float8'])}"]
        if float8_experts(case["float8"]):
            cmd.append("--float8.moe_experts=true")
        if _fp8_all_gather(case):
            cmd += ["--float8.enable_fsdp_float8_all_gather=true",
                    "--float8.precompute_float8_dynamic_scale_for_fsdp=true"]
    return cmd + list(opts.extra)


def peer_cmd(case: dict, opts) -> list[str] | None:
    """torchtitan 0.2.2 flags for the same shape; None when the peer cannot run it. (loss_chunk is titanlike's own
    memory lever: the peer runs the shape with its full logits. peer_ac gives the peer its own AC where the two fit
    best with different settings, e.g. at long context.)"""
    hf, trl = opts.peer == PEER_HF, opts.peer == PEER_TRL
    if (case["model"] in vision.VISION_MODELS) != (opts.peer == PEER_TIMM or hf and case["model"] == "llava"):
        return None  # vit runs against timm only, llava against transformers (--peer hf), the rest never on timm
    if trl != bool(case["post"]):  # post-training cases run against TRL only, and TRL runs only those
        return None
    if trl and (case["nproc"] > 1 or case["layout"] or case["float8"] != "none"):
        return None  # the TRL peer is one process in bf16
    if float8_experts(case["float8"]):
        return None  # torchtitan's grouped-GEMM float8 converter flags are not wired here: titanlike runs alone
    if not (hf or trl or opts.peer == PEER_TIMM) and case["flavor"] not in PEER_FLAVORS.get(case["model"], ()):
        return None
    ac, ac_option = peer_ac(case)
    if not hf and case["model"] in ENCODER_MODELS:
        return None  # torchtitan does not train BERT or T5: their peer is transformers' (--peer hf)
    args = [sys.executable, opts.peer, "--vocab", str(vocab_of(case, opts)), "--model", case["model"]] if hf else \
        ["bash", opts.peer]
    if case["model"] in vision.VISION_MODELS:
        args = vision.peer_args(case, opts, vocab_of(case, opts))
        if args is None:  # (llava on timm's launcher)
            return None
    if hf and case["dec_seq"]:
        args += ["--decoder-len", str(case["dec_seq"])]
    if trl:
        args = [sys.executable, opts.peer, case["post"], "--vocab", str(vocab_of(case, opts)), "--data",
                opts.post_data]
    args += [case["flavor"], "--training.seq_len", str(case["seq"]),
            "--training.local_batch_size", str(case["batch"]), "--training.steps", str(opts.steps),
            "--metrics.log_freq", str(opts.log_freq),
            "--activation_checkpoint.mode", ac, *_ac_option_flags(ac, ac_option, "--activation_checkpoint.", " ",
                                                                  selective_key="selective_ac_option")]
    if case["compile"]:
        args.append("--compile.enable")
    for k, v in parse_layout(case["layout"]).items():
        args += [f"--parallelism.{PEER_DEGREE[k]}", str(v)]
    if case["float8"] != "none":
        args += ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.filter_fqns", "output"]
        if case["float8"] != "tensorwise":
            args += ["--quantize.linear.float8.recipe_name", case["float8"]]
        elif _fp8_all_gather(case):
            args += ["--quantize.linear.float8.enable_fsdp_float8_all_gather",
                     "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp"]
    return args + list(opts.peer_extra)


def flops_per_unit(case: dict, vocab: int) -> float | None:
    """FLOPs per unit of tokens_per_step: per image (vit), per decoder token (llava), else per token."""
    if case["model"] in vision.VISION_MODELS:
        return vision.flops_per_unit(case, vocab)
    return flops_per_token(case["model"], case["flavor"], case["seq"], vocab, dec_seq=case["dec_seq"])


def flops_per_token(model: str, flavor: str, seq: int, vocab: int, dec_seq: int = 0) -> float | None:
    """Model FLOPs per token (the ModelSpec's count, as the trainer logs it); None for an unknown flavor. T5: per
    encoder token, the decoder dec_seq long (0: the span objective's length for seq), as peer_hf.py counts it."""
    try:
        import models

        spec = models.get_spec(model)
        args = dataclasses.replace(spec.flavors[flavor], vocab_size=vocab, max_seq_len=seq,
                                   **({"decoder_multiple": dec_seq} if dec_seq else {}))
        return spec.flops_per_token(args, seq)
    except (KeyError, ValueError, ImportError):
        return None


def cache_env(opts, case: dict, who: str, keep: bool) -> dict:
    """Environment for one run's compile caches: its own Inductor and Triton directories under the dump folder
    (emptied first unless `keep`), or nothing with --compile-cache shared."""
    if opts.compile_cache == "shared":
        return {}
    root = os.path.join(opts.dump_folder, "compile_caches", re.sub(r"[^A-Za-z0-9_.-]+", "_", label(case)), who)
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"), "TRITON_CACHE_DIR": os.path.join(root, "triton")}


def warm_first_step(cmd_fn, parse, case: dict, opts, env: dict, who: str, tokens: int, fpt) -> float | None:
    """The first step's seconds of a 3-step rerun on the caches the cold run left (--warm)."""
    short = argparse.Namespace(**{**vars(opts), "steps": 3})
    cmd = cmd_fn(case, short)
    if cmd is None:
        return None
    text, rc, _ = run(cmd, {**env, **cache_env(opts, case, who, keep=True)}, None, opts.timeout)
    return summarize(parse(text), 0, tokens, fpt).get("first_step_s") if rc == 0 else None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for axis, (kind, default) in AXES.items():
        # on/off axes also work as bare flags ("--compile" = "--compile on"), as in earlier command lines
        p.add_argument(f"--{axis.replace('_', '-')}", dest=axis, default=None,
                       **({"nargs": "?", "const": "on"} if kind is on_off else {}),
                       help=f"comma-separated values (default {default!r})")
    p.add_argument("--matrix", default="", help="TOML file with [defaults] and [[case]] tables")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="first steps excluded from the medians")
    p.add_argument("--log-freq", type=int, default=1,
                   help="both log (and read the loss back, a host sync) every N steps; each line's tok/s covers its N")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary of both sides (0: 30522 bert, 32128 t5 (their "
                   "flavors'), else 128256)")
    p.add_argument("--data", default="stdlib", help="titanlike dataset: stdlib (real text) or mock (random tokens); "
                   "vit / llava: mock (the default), jpeg (WebDataset JPEG shards, decoded in the loader) or shapes "
                   "(vit)")
    p.add_argument("--image-data", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "titanlike_images"),
                   help="--data jpeg: the folder its shards are written to once (jpeg<side>/)")
    p.add_argument("--peer", default="", help="the peer's launcher: 'auto' = this checkout's "
                   "scripts/bench/peer_torchtitan.sh, 'hf' = scripts/bench/peer_hf.py (transformers + fla), 'trl' = "
                   "scripts/bench/peer_trl.py for the post-training cases (--post; 'trl-sft', 'trl-lora', 'trl-dpo' "
                   "also set --post; DPO is compared in pairs per second, --batch counting titanlike's packed rows "
                   "and TRL's pairs), or a path; empty (default) = titanlike only")
    p.add_argument("--post-data", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "titanlike_post"),
                   help="post-training cases: the folder of scripts/bench/post_training_data.py (written when missing)")
    p.add_argument("--only", choices=("titanlike", "peer"), default=None,
                   help="run one side only, with the flags, vocabulary and data both sides would get (a side whose "
                        "cold first step needs a call of its own); --only peer needs --peer")
    p.add_argument("--peer-extra", default="", help="extra arguments for the peer (one string, split on spaces)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (a run past it counts as failed)")
    p.add_argument("--compile-cache", choices=("fresh", "shared"), default="fresh",
                   help="fresh (default): each framework and case compiles into its own empty Inductor/Triton cache "
                        "directories, so the first step is a cold start for both; shared: torch's default caches, "
                        "whatever earlier runs left there")
    p.add_argument("--warm", action="store_true",
                   help="with fresh caches: run each case again for 3 steps on the caches its cold run left, and "
                        "report that first step too (first_step_warm_s)")
    p.add_argument("--dump-folder", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "titanlike_bench"))
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--log", default="", help="prefix for the full logs of every run")
    p.add_argument("extra", nargs="*", help="extra --section.key=value for titanlike (after --)")
    a = p.parse_args(argv)
    a.peer_extra = a.peer_extra.split()
    if a.peer.startswith("trl-"):  # trl-sft: --peer trl --post sft
        a.peer, a.post = "trl", a.post or a.peer[len("trl-"):]
    a.peer = resolve_peer(a.peer)
    if a.only == "peer" and not a.peer:
        p.error("--only peer needs --peer (auto, hf, trl or a launcher's path)")
    toml_text = open(a.matrix).read() if a.matrix else None
    cases = expand_matrix({k: getattr(a, k) for k in AXES}, toml_text)
    if any(c["post"] for c in cases):
        from post_training_data import ensure  # the same chat/preference records and tokenizer for both sides

        ensure(a.post_data)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = {"environment": environment(), "steps": a.steps, "warmup": a.warmup, "data": a.data,
           "vocab": a.vocab or "per case"}
    results, peer_runs = [], {}
    for i, case in enumerate(cases):
        tokens = tokens_per_step(case)  # so step times come out right for every layout
        fpt = flops_per_unit(case, vocab_of(case, a))
        ours = parse_ours  # titanlike's lines, in the case's unit (images/s, llava's decoder tokens/s)
        if case["model"] in vision.VISION_MODELS:
            def ours(text, case=case):
                return vision.scale_ours(parse_ours(text), case)
        res = {"label": label(case), "case": case, "flops_per_token": fpt, "vocab": vocab_of(case, a)}
        log = a.log and f"{a.log}.{i}"
        if a.only != "peer":
            text, rc, wall = run(titanlike_cmd(case, a), {**env, **cache_env(a, case, "titanlike", keep=False)},
                                 log and log + ".titanlike.log", a.timeout)
            res["titanlike"] = {**summarize(ours(text), a.warmup, tokens, fpt), "rc": rc, "wall_s": wall,
                                "compile_cache": a.compile_cache}
            if a.warm and a.compile_cache == "fresh" and rc == 0:
                res["titanlike"]["first_step_warm_s"] = warm_first_step(titanlike_cmd, ours, case, a, env,
                                                                        "titanlike", tokens, fpt)
            fill = pack_fill(text) if case["post"] in ("sft", "lora") else None
            if fill is not None:  # the peer counts only real tokens (padding-free): compare on those
                res["titanlike"]["pack_fill"] = fill
        cmd = peer_cmd(case, a) if a.peer and a.only != "titanlike" else None
        if cmd and tuple(cmd) in peer_runs:  # the same peer run for cases that differ only in titanlike's levers
            res["peer"] = peer_runs[tuple(cmd)]
        elif cmd:
            peer_env = {**env, "NPROC": str(case["nproc"]), "MODEL": case["model"]}
            text, rc, wall = run(cmd, {**peer_env, **cache_env(a, case, "peer", keep=False)},
                                 log and log + ".peer.log", a.timeout)
            peer_tokens = tokens_per_step(case, peer=True)
            pairs = case["batch"] if case["post"] == "dpo" else None  # TRL's DPO step: batch pairs
            res["peer"] = peer_runs[tuple(cmd)] = {**summarize(parse_peer(text), a.warmup, peer_tokens, fpt,
                                                               pairs_per_step=pairs),
                                                   "rc": rc, "wall_s": wall, "compile_cache": a.compile_cache}
            if a.warm and a.compile_cache == "fresh" and rc == 0:
                res["peer"]["first_step_warm_s"] = warm_first_step(peer_cmd, parse_peer, case, a, peer_env, "peer",
                                                                    peer_tokens, fpt)
        if "peer" in res and "titanlike" in res:
            res.update(post_training_ratio(case, res["titanlike"], res["peer"]))
        results.append(res)
        print("\n".join(format_table([res]).splitlines()[2:]), flush=True)
        comparisons = compare_to_bf16(results)
        if a.out:  # after every case: a run cut short by the machine's time limit keeps what it measured
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump({**out, "results": results}, f, indent=2)
    print("\n" + format_table(results))
    for line in comparisons if cases else []:
        print(line)
    return {**out, "results": results}


if __name__ == "__main__":
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_runs)
    res = main()
    failed = [r["label"] for r in res["results"] for who in ("titanlike", "peer") if r.get(who, {}).get("rc")]
    sys.exit(1 if failed else 0)
