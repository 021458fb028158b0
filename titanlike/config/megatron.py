"""Megatron-LM `pretrain_gpt.py` flags -> a titanlike TOML (scripts/from_megatron.py, docs/megatron.md).

FLAGS below is the documentation: Megatron flag -> (section.key, converter). Flags that shape the model, the LR
schedule or the data are read together by the small functions after it. Every flag that cannot be mapped comes back in
`unmapped` with the reason; flags that need no key (titanlike's default already does it) come back in `notes`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from models import DEFAULT_MODEL, get_spec
from titanlike.config.load import _toml_value
from titanlike.config.sections import JobConfig, LossScaling


class MegatronError(ValueError):
    """A flag block that cannot be read or that contradicts itself (a flag without its value, --fp16 with --bf16)."""


def _num(v: str) -> float:
    return float(v)


def _whole(v: str) -> int:
    """Megatron parses some counts as floats (--loss-scale-window 1000.0): accept those when they are whole."""
    x = float(v)
    if x != int(x):
        raise ValueError(v)
    return int(x)


_PLAIN = {  # Megatron flag -> (section.key, converter from the flag's text)
    "--micro-batch-size": ("training.local_batch_size", int),
    "--global-batch-size": ("training.global_batch_size", int),
    "--seq-length": ("training.seq_len", int),
    "--tensor-model-parallel-size": ("parallelism.tp", int),
    "--pipeline-model-parallel-size": ("parallelism.pp", int),
    "--context-parallel-size": ("parallelism.cp", int),
    "--expert-model-parallel-size": ("parallelism.ep", int),
    "--num-layers-per-virtual-pipeline-stage": ("parallelism.pp_layers_per_stage", int),
    "--train-iters": ("training.steps", int),
    "--lr": ("optimizer.lr", _num),
    "--weight-decay": ("optimizer.weight_decay", _num),
    "--adam-eps": ("optimizer.eps", _num),
    "--clip-grad": ("training.max_norm", _num),
    "--seed": ("training.seed", int),
    "--split": ("data.split", str),
    "--tokenizer-type": ("data.tokenizer_type", str),
    "--vocab-file": ("data.vocab_file", str),
    "--merge-file": ("data.merge_file", str),
    "--tokenizer-model": ("data.tokenizer_model", str),
    "--save-interval": ("checkpoint.interval", int),
    "--eval-interval": ("validation.interval", int),
    "--eval-iters": ("validation.steps", int),
    "--log-interval": ("metrics.log_freq", int),
    "--save": ("job.dump_folder", str),
    "--virtual-pipeline-model-parallel-size": ("parallelism.pp_stages_per_rank", int),
    "--num-workers": ("data.num_workers", int),
    "--wandb-project": ("metrics.wandb_project", str),
    "--wandb-entity": ("metrics.wandb_entity", str),
    "--wandb-exp-name": ("job.run_name", str),
    "--loss-scale": ("loss_scaling.static_scale", _num),
    "--initial-loss-scale": ("loss_scaling.initial_scale", _num),
    "--min-loss-scale": ("loss_scaling.min_scale", _num),
    "--loss-scale-window": ("loss_scaling.window", _whole),
    "--hysteresis": ("loss_scaling.hysteresis", int),
}
_SWITCHES = {  # flags without a value -> (section.key, value)
    "--sequence-parallel": ("parallelism.enable_sequence_parallel", True),
    "--bf16": ("training.mixed_precision_param", "bfloat16"),
    "--fp16": ("training.mixed_precision_param", "float16"),
    "--reset-attention-mask": ("data.document_masking", True),
    "--reset-position-ids": ("data.reset_position_ids", True),
    "--eod-mask-loss": ("data.eod_mask_loss", True),
    "--use-flash-attn": ("model.attn_backend", "flash"),
}
_NOTED = {  # flags titanlike already does by default: no key, a note
    "--use-distributed-optimizer": "FSDP (parallelism.dp_shard=-1) shards optimizer state by default",
    "--distributed-backend": "titanlike picks nccl on CUDA, gloo on CPU",
    "--use-mcore-models": "titanlike has one model implementation per family",
    "--no-masked-softmax-fusion": "no fused-softmax knob: attention goes through SDPA/flash",
    "--no-bias-gelu-fusion": "no fusion knob; use compile.enable for fused kernels",
    "--no-bias-dropout-fusion": "no fusion knob; use compile.enable for fused kernels",
    "--no-gradient-accumulation-fusion": "no fusion knob",
    "--disable-bias-linear": "the RoPE/SwiGLU family has no linear biases (the gpt family keeps GPT-2's)",
    "--overlap-grad-reduce": "FSDP overlaps the gradient reduce-scatter with backward by default",
    "--overlap-param-gather": "FSDP prefetches the next block's parameters during compute by default",
    "--transformer-impl": "titanlike has one implementation (torch); FP8 is float8.enable",
}
_WHY = {  # flags known to have no titanlike equivalent yet -> why
    "--load": ("Megatron checkpoints are converted, not read by the trainer: python scripts/convert_megatron.py "
               "import <--load folder> <out>, then checkpoint.initial_load_path=<out>; titanlike resumes from its "
               "own checkpoints by itself"),
    "--init-method-std": "init std is a flavor field (models/*/args.py init_std), not a config key",
    "--attention-dropout": "dropout is a flavor field (gpt args attn_dropout), not a config key",
    "--hidden-dropout": "dropout is a flavor field (gpt args hidden_dropout), not a config key",
    "--num-experts": "MoE sizes live in the MoE families' flavors (mixtral, deepseek_v3, qwen3): pick one",
    "--moe-router-topk": "MoE sizes live in the MoE families' flavors (mixtral, deepseek_v3, qwen3): pick one",
    "--recompute-method": "titanlike checkpoints whole blocks (activation_checkpoint.mode=full) or by op",
    "--tensorboard-dir": "TensorBoard writes under the run folder: metrics.save_tb_folder is relative to it",
}
_MODEL = ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--max-position-embeddings",
          "--num-query-groups", "--position-embedding-type", "--normalization")
_MODEL_SWITCHES = ("--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights")
_SCHED = ("--min-lr", "--lr-decay-style", "--lr-warmup-iters", "--lr-warmup-fraction", "--lr-decay-iters",
          "--adam-beta1", "--adam-beta2", "--recompute-granularity", "--recompute-num-layers", "--data-path",
          "--make-vocab-size-divisible-by")
VALUED = set(_PLAIN) | set(_MODEL) | set(_SCHED) | {"--distributed-backend", "--transformer-impl", "--load",
    "--init-method-std", "--attention-dropout", "--hidden-dropout", "--num-experts", "--moe-router-topk",
    "--recompute-method", "--tensorboard-dir"}
# Megatron's defaults where titanlike's differ: set when the block leaves the flag out, so the run is the one Megatron
# would have trained (flag -> key, Megatron's default; --adam-beta1/2 are read together in _schedule).
DEFAULTS = {
    "--lr-decay-style": ("lr_scheduler.decay_type", "linear"),
    "--min-lr": ("lr_scheduler.min_lr_factor", 0.0),
    "--lr-warmup-iters": ("lr_scheduler.warmup_steps", 0),
    "--weight-decay": ("optimizer.weight_decay", 0.01),
    "--adam-beta2": ("optimizer.betas", [0.9, 0.999]),
    "--seed": ("training.seed", 1234),
    "--log-interval": ("metrics.log_freq", 100),
}
_LAUNCHER = {"nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "rdzv_backend"}
FLAG_TABLE = {**{k: v[0] for k, v in _PLAIN.items()}, **{k: v[0] for k, v in _SWITCHES.items()}}


# Unmapped flags that change *what* is trained (the model's shape, MoE, an unexpanded $VAR that may hold anything):
# a TOML can still be written and edited by hand, but `scripts/train.py --megatron-args` refuses to train without them.
_REQUIRED = {"--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--num-query-groups", "--num-layers",
             "--num-experts", "--moe-router-topk"}


@dataclass
class Translation:
    values: dict[str, dict[str, object]] = field(default_factory=dict)
    unmapped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)

    def required(self) -> list[tuple[str, str]]:
        """The unmapped flags without which a run would train something else than the flag block asks for."""
        return [(f, why) for f, why in self.unmapped if f in _REQUIRED or "shell variable" in why or "is not a" in why]

    def set(self, dotted: str, value: object) -> None:
        section, key = dotted.split(".")
        self.values.setdefault(section, {})[key] = value


def tokenize(text: str) -> list[str]:
    """Shell flag block -> tokens: comments, line continuations, quotes and `VAR="` wrappers dropped."""
    out: list[str] = []
    for line in text.splitlines():
        line = re.sub(r"(^|\s)#.*", "", line).replace("\\", " ")
        line = re.sub(r"^\s*[A-Za-z_]\w*=", "", line).replace('"', " ").replace("'", " ")
        out.extend(line.split())
    return out


_COMMAND_ENDS = {"|", "||", "&&", ";", "&"}
STRAY = "(stray words)"  # parse()'s key for words after a --flag=value


def parse(tokens: list[str]) -> dict[str, list[str]]:
    """{flag: values} ([] for a switch). Tokens before the first flag (python, pretrain_gpt.py) are skipped."""
    flags: dict[str, list[str]] = {}
    current = None
    for tok in tokens:
        if tok in _COMMAND_ENDS:  # `... | tee log`, `... && echo done`: the rest is another command
            break
        if ">" in tok:  # a redirect (2>&1, >log): shell plumbing, not a flag value
            continue
        if tok.startswith("$"):
            flags[tok], current = [], None
        elif tok.startswith("--"):
            name, eq, val = tok.partition("=")
            flags[name] = [val] if eq else []
            current = None if eq else name  # --flag=value is complete: words after it are strays
        elif current is None and flags and not tok.endswith(".py") and tok not in ("python", "python3"):  # launcher
            flags.setdefault(STRAY, []).append(tok)
        elif current is not None:
            flags[current].append(tok)
    for name, vals in flags.items():
        if name in VALUED and not vals:
            raise MegatronError(f"{name} needs a value")
    return flags


def _closest(flavors: dict, dim: int, heads: int, match) -> tuple[str, bool]:
    exact = [n for n, a in flavors.items() if a.dim == dim and a.n_heads == heads and match(a)]
    if exact:
        return exact[0], True
    return min(flavors, key=lambda n: (abs(flavors[n].dim - dim), abs(flavors[n].n_heads - heads))), False


def _model(f: dict[str, list[str]], t: Translation) -> None:
    one = lambda k: int(f[k][0]) if k in f else None  # noqa: E731
    layers, dim, heads = one("--num-layers"), one("--hidden-size"), one("--num-attention-heads")
    ffn = one("--ffn-hidden-size")
    rope = (f.get("--position-embedding-type", [""])[0] == "rope" or "--swiglu" in f
             or f.get("--normalization", [""])[0] == "RMSNorm" or "--group-query-attention" in f)
    for k in ("--position-embedding-type", "--normalization", "--swiglu", "--group-query-attention"):
        if k in f:
            t.notes.append((k, f"chose the {DEFAULT_MODEL} family (RoPE, SwiGLU, RMSNorm, GQA)" if rope
                            else "the gpt family's default"))
    if "--untie-embeddings-and-output-weights" in f:
        t.unmapped.append(("--untie-embeddings-and-output-weights", "tying is a flavor field (tie_embeddings)"))
    if dim is None or heads is None:
        for k in ("--num-layers", "--ffn-hidden-size", "--num-query-groups", "--hidden-size", "--num-attention-heads"):
            if k in f:
                t.unmapped.append((k, "needs --hidden-size and --num-attention-heads to pick a flavor"))
        return
    if rope:  # the default family is the RoPE/SwiGLU/RMSNorm/GQA one
        from models.common.ffn import ffn_hidden_dim
        name = DEFAULT_MODEL
        kv = one("--num-query-groups") if "--group-query-attention" in f else heads
        match = lambda a: a.n_kv_heads == kv and (  # noqa: E731
            ffn is None or ffn == ffn_hidden_dim(a.dim, a.multiple_of, a.ffn_dim_multiplier))
    else:
        name = "gpt"
        match = lambda a: ffn is None or ffn == a.hidden_dim  # noqa: E731
    flavors = get_spec(name).flavors
    flavor, exact = _closest(flavors, dim, heads, match)
    t.set("model.name", name)
    t.set("model.flavor", flavor)
    a = flavors[flavor]
    if layers is not None and layers != a.n_layers:
        t.set("model.n_layers", layers)
    if not exact:
        why = (f"titanlike sizes live in flavors; no {name} flavor has this shape, closest is {flavor!r} "
               f"(dim {a.dim}, {a.n_heads} heads): add a flavor to models/{name}/flavors.py")
        for k in ("--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--num-query-groups"):
            if k in f:
                t.unmapped.append((k, why))
    else:
        for k in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--num-query-groups"):
            if k in f:
                t.notes.append((k, f"matches flavor {name}/{flavor}"))
    if "--max-position-embeddings" in f:
        seq = one("--seq-length")
        if seq is not None and one("--max-position-embeddings") != seq:
            t.unmapped.append(("--max-position-embeddings", "titanlike sizes positions to training.seq_len"))
        else:
            t.notes.append(("--max-position-embeddings", "titanlike sizes positions to training.seq_len"))


def _schedule(f: dict[str, list[str]], t: Translation) -> None:
    one = lambda k: f[k][0]  # noqa: E731
    if "--min-lr" in f:
        if "--lr" in f:
            t.set("lr_scheduler.min_lr_factor", float(one("--min-lr")) / float(one("--lr")))
        else:
            t.unmapped.append(("--min-lr", "needs --lr (min_lr_factor = min_lr / lr)"))
    if "--lr-decay-style" in f:
        style = one("--lr-decay-style")
        if style in ("cosine", "linear", "constant", "WSD", "wsd"):
            t.set("lr_scheduler.decay_type", style.lower())
        else:
            t.unmapped.append(("--lr-decay-style", f"{style!r} has no decay_type (cosine, linear, wsd, constant)"))
    if "--lr-warmup-iters" in f:
        t.set("lr_scheduler.warmup_steps", int(one("--lr-warmup-iters")))
    if "--lr-warmup-fraction" in f:
        if "--train-iters" in f:
            t.set("lr_scheduler.warmup_steps", round(float(one("--lr-warmup-fraction")) * int(one("--train-iters"))))
        else:
            t.unmapped.append(("--lr-warmup-fraction", "needs --train-iters to become warmup_steps"))
    if "--lr-decay-iters" in f:
        if one("--lr-decay-iters") == f.get("--train-iters", [None])[0]:
            t.notes.append(("--lr-decay-iters", "equals --train-iters: titanlike decays over training.steps"))
        else:
            t.unmapped.append(("--lr-decay-iters", "titanlike decays over training.steps; a different decay "
                               "length has no key"))
    if "--adam-beta1" in f or "--adam-beta2" in f:
        t.set("optimizer.betas", [float(f.get("--adam-beta1", ["0.9"])[0]), float(f.get("--adam-beta2", ["0.999"])[0])])
    if "--recompute-granularity" in f:
        g = one("--recompute-granularity")
        t.set("activation_checkpoint.mode", "full" if g == "full" else "selective")
        if g == "selective":
            t.set("activation_checkpoint.selective_option", "attention")
    if "--recompute-num-layers" in f:
        n = int(one("--recompute-num-layers"))
        if n == 1:
            t.notes.append(("--recompute-num-layers", "1: every block is checkpointed (activation_checkpoint.mode)"))
        else:
            t.unmapped.append(("--recompute-num-layers", "titanlike checkpoints per block, not groups of blocks"))
    if "--data-path" in f:
        t.set("data.dataset", "indexed")
        t.set("data.paths", list(f["--data-path"]))
    if "--eval-interval" in f or "--eval-iters" in f:
        t.set("validation.enable", True)
    if "--save" in f:
        t.set("checkpoint.enable", True)
        t.notes.append(("--save", "checkpoints go to <job.dump_folder>/<run name>/<checkpoint.folder>"))


def translate(flags: dict[str, list[str]]) -> Translation:
    t = Translation()
    for name, vals in flags.items():
        if name.startswith("$"):
            t.unmapped.append((name, "a shell variable: expand it first"))
        elif name == STRAY:
            t.unmapped.append((" ".join(vals), "stray words, not after a flag that takes them"))
        elif any("$" in v for v in vals):  # --data-path=$DATA_DIR/x: the value is not known here
            t.unmapped.append((name, f"{' '.join(vals)!r} holds a shell variable: expand it first"))
        elif name in _PLAIN:
            key, conv = _PLAIN[name]
            try:
                t.set(key, conv(" ".join(vals)))
            except ValueError:
                kind = "number" if conv is _num else "whole number"
                t.unmapped.append((name, f"value {' '.join(vals)!r} is not a {kind}"))
        elif name in _SWITCHES:
            t.set(*_SWITCHES[name])
            if vals:
                t.unmapped.append((" ".join(vals), f"stray words after the switch {name}"))
        elif name in _NOTED:
            t.notes.append((name, _NOTED[name]))
        elif name in _WHY:
            t.unmapped.append((name, _WHY[name]))
        elif name.lstrip("-") in _LAUNCHER:
            t.unmapped.append((name, "a torchrun launcher flag: pass it to torchrun/scripts/slurm, not the config"))
        elif name not in _MODEL and name not in _MODEL_SWITCHES and name not in _SCHED:
            t.unmapped.append((name, "turns off a Megatron feature or fusion titanlike has no key for" if
                               name.startswith("--no-") else "unknown to this translator: no titanlike key"))
    # several stages per rank: Megatron's interleaved 1F1B
    if "--num-layers-per-virtual-pipeline-stage" in flags or "--virtual-pipeline-model-parallel-size" in flags:
        t.set("parallelism.pp_schedule", "Interleaved1F1B")
    if "--wandb-project" in flags:  # Megatron logs to W&B exactly when a project is named
        t.set("metrics.enable_wandb", True)
    # Megatron's iteration line ("iteration N/ M | ... | lm loss: ...") so log parsers written for it keep working
    t.set("metrics.log_format", "megatron")
    _precision(flags, t)
    _vocab_padding(flags, t)
    _model(flags, t)
    _schedule(flags, t)
    for flag, (key, value) in DEFAULTS.items():
        section, name = key.split(".")
        if flag not in flags and name not in t.values.get(section, {}):  # --lr-warmup-fraction also sets warmup
            t.set(key, value)
    return t


def _precision(f: dict[str, list[str]], t: Translation) -> None:
    """fp16 and its loss scaling: contradictions are errors (Megatron's own checks), not unmapped flags."""
    if "--fp16" in f and "--bf16" in f:
        raise MegatronError("--fp16 and --bf16 contradict each other: keep one (--bf16 needs no loss scaling)")
    ls = t.values.get("loss_scaling", {})
    if "static_scale" in ls and not ls["static_scale"] > 0:
        raise MegatronError(f"--loss-scale {ls['static_scale']:g} must be > 0; leave it out for dynamic loss scaling")
    init, low = ls.get("initial_scale", LossScaling.initial_scale), ls.get("min_scale", LossScaling.min_scale)
    if low > init:
        raise MegatronError(f"--min-loss-scale {low:g} is above --initial-loss-scale {init:g}: the dynamic scale starts "
                            f"at the initial one and never goes below the minimum; lower --min-loss-scale")
    for flag, key in (("--hysteresis", "hysteresis"), ("--loss-scale-window", "window")):
        if key in ls and ls[key] < 1:
            raise MegatronError(f"{flag} {ls[key]} must be >= 1")
    if ls and "--fp16" not in f:
        for flag in ("--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis"):
            if flag in f:
                t.notes.append((flag, "loss scaling only acts with --fp16 (training.mixed_precision_param = "
                                      "\"float16\"); kept, but unused in this run"))


def _vocab_padding(f: dict[str, list[str]], t: Translation) -> None:
    """Megatron pads the tokenizer's vocabulary to a multiple of --make-vocab-size-divisible-by (default 128) times
    the TP size (GPT-2's 50257 -> 50304): the same shapes, and checkpoints that convert row for row."""
    text = " ".join(f.get("--make-vocab-size-divisible-by", ["128"]))
    try:
        n = int(text)
    except ValueError:
        raise MegatronError(f"--make-vocab-size-divisible-by {text!r} is not a whole number") from None
    if n < 1:
        raise MegatronError(f"--make-vocab-size-divisible-by {n} must be >= 1")
    t.set("model.vocab_pad_multiple", n * int(t.values.get("parallelism", {}).get("tp", 1)))


def to_toml(t: Translation, header: str = "Translated from Megatron-LM flags by scripts/from_megatron.py") -> str:
    lines = [f"# {header}"]
    order = [f.name for f in fields(JobConfig)]
    for section, table in sorted(t.values.items(), key=lambda kv: order.index(kv[0])):
        lines += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    lines.append("")
    lines += [f"# note: {flag}: {text}" for flag, text in t.notes]
    lines += [f"# unmapped: {flag}: {why}" for flag, why in t.unmapped]
    return "\n".join(lines) + "\n"
