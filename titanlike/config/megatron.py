"""Megatron-LM `pretrain_gpt.py` flags -> a titanlike TOML (scripts/from_megatron.py, docs/megatron.md).

translate_text() takes a whole launch script (megatron_shell.py finds the launch and expands the script's own
variables). The tables below are the documentation: Megatron flag -> (section.key, converter). The model flags are
read together by megatron_model.py; the LR schedule and the data by the small functions after the tables. Every flag
that cannot be mapped comes back in `unmapped` with the reason; flags that need no key come back in `notes`; what
the user must hear (which model was chosen, and why) in `said`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from titanlike.config import megatron_encoder, megatron_model
from titanlike.config.load import _toml_value
from titanlike.config.megatron_model import number
from titanlike.config.megatron_shell import MegatronError, read_launch
from titanlike.config.sections import JobConfig, LossScaling

__all__ = ["MegatronError", "Translation", "parse", "to_toml", "tokenize", "translate", "translate_text"]
_num, _whole = float, int  # the converters of the table: number() reads the flag's text as one of these


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
    "--mock-data": ("data.dataset", "mock"),  # Megatron's synthetic tokens; titanlike's mock dataset is the same idea
}
_NOTED = {  # flags titanlike already does by default: no key, a note
    "--use-distributed-optimizer": "FSDP (parallelism.dp_shard=-1) shards optimizer state by default",
    "--distributed-backend": "titanlike picks nccl on CUDA, gloo on CPU",
    "--use-mcore-models": "titanlike has one model implementation per family",
    "--no-masked-softmax-fusion": "no fused-softmax knob: attention goes through SDPA/flash",
    "--no-bias-gelu-fusion": "no fusion knob; use compile.enable for fused kernels",
    "--no-bias-dropout-fusion": "no fusion knob; use compile.enable for fused kernels",
    "--no-gradient-accumulation-fusion": "no fusion knob",
    "--overlap-grad-reduce": "FSDP overlaps the gradient reduce-scatter with backward by default",
    "--overlap-param-gather": "FSDP prefetches the next block's parameters during compute by default",
    "--transformer-impl": "titanlike has one implementation (torch); FP8 is float8.enable",
}
_WHY = {  # flags known to have no titanlike equivalent yet -> why
    "--load": ("Megatron checkpoints are converted, not read by the trainer: python scripts/convert_megatron.py "
               "import <--load folder> <out>, then checkpoint.initial_load_path=<out>; titanlike resumes from its "
               "own checkpoints by itself"),
    "--num-experts": ("a mixture of experts is a flavor of an MoE family (models/): give it with --config and "
                      "drop the MoE flags"),
    "--moe-router-topk": "the router's top-k is part of an MoE family's flavor (see --num-experts)",
    "--recompute-method": "titanlike checkpoints whole blocks (activation_checkpoint.mode=full) or by op",
    "--tensorboard-dir": "TensorBoard writes under the run folder: metrics.save_tb_folder is relative to it",
    "--no-position-embedding": ("deprecated: Megatron-LM refuses it unless the positions are rope; write "
                                "--position-embedding-type none (a hybrid model) instead"),
}
_SCHED = ("--min-lr", "--lr-decay-style", "--lr-warmup-iters", "--lr-warmup-fraction", "--lr-decay-iters",
          "--adam-beta1", "--adam-beta2", "--recompute-granularity", "--recompute-num-layers", "--data-path",
          "--make-vocab-size-divisible-by")
# --cp-comm-type (several values: one per layer) -> parallelism.cp_method; "a2a+p2p" (hierarchical) has none
_CP_COMM = {"allgather": "allgather", "a2a": "alltoall", "p2p": "ring"}
VALUED = set(_PLAIN) | set(megatron_model.VALUED) | set(_SCHED) | megatron_encoder.VALUED
VALUED |= {"--distributed-backend", "--transformer-impl",
    "--load", "--num-experts", "--moe-router-topk", "--recompute-method", "--tensorboard-dir",
    "--max-position-embeddings", megatron_model.SPEC, "--cp-comm-type"}
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


# Unmapped flags that change *what* is trained (the model, MoE, the data, a $VAR the script never sets, words that
# are no flag: a placeholder like `[... other args ...]`): a TOML can still be written and edited by hand, but
# `scripts/train.py --megatron-args` refuses to train without them.
_REQUIRED = megatron_model.FLAGS | {"--num-experts", "--moe-router-topk", "--data-path", "--save"}
_REQUIRED_WHY = ("shell variable", "stray words", "a pretrain_bert.py / pretrain_t5.py flag")


@dataclass
class Translation:
    values: dict[str, dict[str, object]] = field(default_factory=dict)
    unmapped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)
    said: list[str] = field(default_factory=list)  # lines the user must read: the model chosen, and why

    def required(self) -> list[tuple[str, str]]:
        """The unmapped flags without which a run would train something else than the flag block asks for."""
        return [(f, why) for f, why in self.unmapped if f in _REQUIRED or any(w in why for w in _REQUIRED_WHY)]

    def set(self, dotted: str, value: object) -> None:
        section, key = dotted.split(".")
        self.values.setdefault(section, {})[key] = value


def tokenize(text: str) -> list[str]:
    """A launch script or flag block -> the flags given to its pretrain script (megatron_shell.py)."""
    return read_launch(text).flags


# flags of several values (a blend: 0.3 prefix_a 0.7 prefix_b; --spec module function); the others take one
_MULTI = {"--data-path", megatron_model.SPEC, "--cp-comm-type"}
STRAY = "(stray words)"  # parse()'s key for words that follow no flag taking them


def parse(tokens: list[str]) -> dict[str, list[str]]:
    """{flag: values} ([] for a switch). A `$VAR` the script never set is the value of a flag still waiting for one
    (`--data-path $DATA_PATH`), else an item of its own (it may hold several flags)."""
    flags: dict[str, list[str]] = {}
    current = None
    for tok in tokens:
        if tok.startswith("$") and not (current in VALUED and not flags[current]):
            flags[tok], current = [], None
        elif tok.startswith("--") and len(tok) > 2:
            name, eq, val = tok.partition("=")
            flags[name] = [val] if eq else []
            current = None if eq else name  # --flag=value is complete: words after it are strays
        elif current is None or (current in VALUED and flags[current] and current not in _MULTI):
            flags.setdefault(STRAY, []).append(tok)
        else:  # (a flag unknown here takes every word up to the next flag)
            flags[current].append(tok)
    for name, vals in flags.items():
        if name in VALUED and not vals:
            raise MegatronError(f"{name} needs a value")
    return flags


def _schedule(f: dict[str, list[str]], t: Translation) -> None:
    one = lambda k: f[k][0]  # noqa: E731
    if "--min-lr" in f:
        if "--lr" in f:
            t.set("lr_scheduler.min_lr_factor", number("--min-lr", one("--min-lr"), float) /
                  number("--lr", one("--lr"), float))
        else:
            t.unmapped.append(("--min-lr", "needs --lr (min_lr_factor = min_lr / lr)"))
    if "--lr-decay-style" in f:
        style = one("--lr-decay-style")
        if style in ("cosine", "linear", "constant", "WSD", "wsd"):
            t.set("lr_scheduler.decay_type", style.lower())
        else:
            t.unmapped.append(("--lr-decay-style", f"{style!r} has no decay_type (cosine, linear, wsd, constant)"))
    if "--lr-warmup-iters" in f:
        t.set("lr_scheduler.warmup_steps", number("--lr-warmup-iters", one("--lr-warmup-iters"), int))
    if "--lr-warmup-fraction" in f:
        if "--train-iters" in f:
            t.set("lr_scheduler.warmup_steps", round(number("--lr-warmup-fraction", one("--lr-warmup-fraction"), float)
                                                     * number("--train-iters", one("--train-iters"), int)))
        else:
            t.unmapped.append(("--lr-warmup-fraction", "needs --train-iters to become warmup_steps"))
    if "--lr-decay-iters" in f:
        if one("--lr-decay-iters") == f.get("--train-iters", [None])[0]:
            t.notes.append(("--lr-decay-iters", "equals --train-iters: titanlike decays over training.steps"))
        else:
            t.unmapped.append(("--lr-decay-iters", "titanlike decays over training.steps; a different decay "
                               "length has no key"))
    if "--adam-beta1" in f or "--adam-beta2" in f:
        t.set("optimizer.betas", [number(k, f.get(k, [d])[0], float) for k, d in (("--adam-beta1", "0.9"),
                                                                                  ("--adam-beta2", "0.999"))])
    if "--recompute-granularity" in f:
        g = one("--recompute-granularity")
        t.set("activation_checkpoint.mode", "full" if g == "full" else "selective")
        if g == "selective":
            t.set("activation_checkpoint.selective_option", "attention")
    if "--recompute-num-layers" in f:
        n = number("--recompute-num-layers", one("--recompute-num-layers"), int)
        if n == 1:
            t.notes.append(("--recompute-num-layers", "1: every block is checkpointed (activation_checkpoint.mode)"))
        else:
            t.unmapped.append(("--recompute-num-layers", "titanlike checkpoints per block, not groups of blocks"))
    remote = [p for p in f.get("--data-path", []) if "://" in p]
    if "--mock-data" in f and "--data-path" in f:
        t.notes.append(("--data-path", "--mock-data trains on synthetic tokens: the data path is not read"))
    elif remote:
        t.unmapped.append(("--data-path", f"{remote[0]}: titanlike reads local files only; copy the dataset's "
                           f".bin/.idx here and give their path"))
    elif "--data-path" in f and not any("$" in p for p in f["--data-path"]):
        t.set("data.dataset", "indexed")
        t.set("data.paths", list(f["--data-path"]))
    if "--eval-interval" in f or "--eval-iters" in f:
        t.set("validation.enable", True)
    if "--save" in f and "://" in one("--save"):
        t.unmapped.append(("--save", f"{one('--save')}: titanlike writes checkpoints to a local or mounted folder; "
                                     f"give one (job.dump_folder)"))
        t.values.get("job", {}).pop("dump_folder", None)
    elif "--save" in f:
        t.set("checkpoint.enable", True)
        t.notes.append(("--save", "checkpoints go to <job.dump_folder>/<run name>/<checkpoint.folder>"))


def translate(flags: dict[str, list[str]], family: str | None = None) -> Translation:
    """`family`: "bert" / "t5" for pretrain_bert.py / pretrain_t5.py blocks (megatron_encoder.py), None for
    pretrain_gpt.py's (the family then follows the model flags)."""
    t = Translation()
    for name, vals in flags.items():
        if name.startswith("$"):
            t.unmapped.append((name, "a shell variable the script does not set (it may hold more flags): set it in "
                                     "the script, or write its flags"))
        elif name == STRAY:
            t.unmapped.append((" ".join(vals), "stray words, not after a flag that takes them (a placeholder? write "
                                               "the flags it stands for)"))
        elif name.lstrip("-") in _LAUNCHER:
            t.unmapped.append((name, "a torchrun launcher flag: pass it to torchrun/scripts/slurm, not the config"))
        elif any("$" in v for v in vals):  # --data-path=$DATA_DIR/x: the value is not known here
            t.unmapped.append((name, f"{' '.join(vals)!r} holds a shell variable the script does not set: set it "
                                     f"in the script, or write the value"))
        elif name in _PLAIN:
            key, conv = _PLAIN[name]
            t.set(key, conv(" ".join(vals)) if conv is str else number(name, " ".join(vals), conv))
        elif name in _SWITCHES:
            t.set(*_SWITCHES[name])
            if vals:
                t.unmapped.append((" ".join(vals), f"stray words after the switch {name}"))
        elif name in _NOTED:
            t.notes.append((name, _NOTED[name]))
        elif name in _WHY:
            t.unmapped.append((name, _WHY[name]))
        elif name in megatron_encoder.FLAGS:
            if family is None:
                t.unmapped.append((name, megatron_encoder.foreign(name)))
        elif name not in megatron_model.FLAGS and name not in _SCHED and name != "--cp-comm-type":
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
    _cp_comm_type(flags, t)
    if any(k in megatron_model.FLAGS and any("$" in x for x in v) for k, v in flags.items()):
        pass  # the unmapped list names the model flag whose value is unknown
    elif family is None:
        megatron_model.build(flags, t)
    else:
        megatron_encoder.build({k: v for k, v in flags.items() if not any("$" in x for x in v)}, t, family)
    _schedule(flags, t)
    if family is not None:
        megatron_encoder.finish(flags, t, family)
    for flag, (key, value) in DEFAULTS.items():
        section, name = key.split(".")
        if flag not in flags and name not in t.values.get(section, {}):  # --lr-warmup-fraction also sets warmup
            t.set(key, value)
    return t


def translate_text(text: str, model_type: str | None = None) -> Translation:
    """A launch script or flag block -> its Translation; MegatronError (one line) when there is nothing to translate
    or the flags contradict themselves. `model_type` (bert, t5, gpt) overrides the launched script's name, which
    otherwise picks BERT (pretrain_bert.py) or T5 (pretrain_t5.py); a bare flag block is pretrain_gpt.py's."""
    launch = read_launch(text)
    if not launch.flags:
        raise MegatronError(f"{launch.script} is launched without flags (line {launch.line}): nothing to translate; "
                            f"give a pretrain_gpt.py launch or its flags")
    t = translate(parse(launch.flags), megatron_encoder.family_of(launch.script, model_type))
    if launch.launcher:
        t.notes.append(("(launcher)", f"{' '.join(launch.launcher)} {launch.script}: how the job starts, not config "
                                      f"(titanlike: torchrun ... scripts/train.py)"))
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
        raise MegatronError(f"--min-loss-scale {low:g} is above --initial-loss-scale {init:g}: the dynamic scale "
                            f"starts at the initial one and never goes below the minimum; lower --min-loss-scale")
    for flag, key in (("--hysteresis", "hysteresis"), ("--loss-scale-window", "window")):
        if key in ls and ls[key] < 1:
            raise MegatronError(f"{flag} {ls[key]} must be >= 1")
    if ls and "--fp16" not in f:
        for flag in ("--loss-scale", "--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis"):
            if flag in f:
                t.notes.append((flag, "loss scaling only acts with --fp16 (training.mixed_precision_param = "
                                      "\"float16\"); kept, but unused in this run"))


def _cp_comm_type(f: dict[str, list[str]], t: Translation) -> None:
    """--cp-comm-type -> parallelism.cp_method (allgather, a2a = alltoall, p2p = ring). Megatron takes one value per
    layer; titanlike one method for all. Left out under CP, Megatron uses p2p: said in a note, not set (the methods
    compute the same; titanlike's default stays)."""
    given = f.get("--cp-comm-type")
    if given is None:
        if t.values.get("parallelism", {}).get("cp", 1) > 1:
            t.notes.append(("--cp-comm-type", "left out: Megatron's default is p2p (parallelism.cp_method = "
                                              "\"ring\"); this run keeps titanlike's \"allgather\", which computes "
                                              "the same (add the flag to choose)"))
        return
    if len(set(given)) > 1:
        t.unmapped.append(("--cp-comm-type", f"{' '.join(given)}: one method per layer; titanlike runs one for every "
                                             f"layer (parallelism.cp_method): give one of allgather, a2a, p2p"))
    elif given[0] in _CP_COMM:
        t.set("parallelism.cp_method", _CP_COMM[given[0]])
    else:
        t.unmapped.append(("--cp-comm-type", f"{given[0]!r} has no titanlike method (a2a+p2p is Megatron's "
                                             f"hierarchical form); give allgather, a2a or p2p"))


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
    lines += [f"# model: {text}" for text in t.said]
    lines += [f"# note: {flag}: {text}" for flag, text in t.notes]
    lines += [f"# unmapped: {flag}: {why}" for flag, why in t.unmapped]
    return "\n".join(lines) + "\n"
