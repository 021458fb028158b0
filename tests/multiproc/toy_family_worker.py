"""torchrun worker for test_dist_model_contract.py: train model families that live only in tests/toy_family.

    toy_family_worker.py ROOT reference   (1 process) seed checkpoints of the toy decoder and the toy vision model,
                                          then a 1-process run of each of the three families
    toy_family_worker.py ROOT fsdp        (2 processes) the same runs under FSDP (dp_shard=-1); the vision run also
                                          saves its last step and a new Trainer resumes from it; the library
                                          families' other layouts, AC and compile (LAYOUT); checkpoints resumed
                                          under another layout (RESHARD)

The families are registered here, at start, the way a user's launcher could: `models.MODELS["toy"] = SPEC`; nothing in
models/, parallelize/ or titanlike/ knows them: the decoder (toy_models, next-token), the bidirectional encoder
(toy_encoder, masked-LM) and the image classifier with a frozen patch projection (toy_vision, its own objective). Checks
that need the live trainer assert here (a failure exits non-zero), every gradient against the reference's among them
(check_grads_at_steps); rank 0 writes ROOT/<phase>.json (losses, grad norms,
the logged throughput metrics, the counts the trainer used and its log lines) for the pytest side to compare across
phases.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

import models
import toy_encoder  # tests/toy_family, put on PYTHONPATH by the test
import toy_models
import toy_vision

FAMILIES = {"toy": toy_models.SPEC, "toy_encoder": toy_encoder.SPEC, "toy_vision": toy_vision.SPEC}
models.MODELS.update(FAMILIES)  # the only registration: no library file lists these families
# A registered library family rides along: the hybrid Mamba-2 / attention / MLP model, on packed documents with full
# activation checkpointing, so its plan (AC -> FSDP) and its doc_ids path are held to the one-process run too.
FAMILIES["nemotron_h"] = models.get_spec("nemotron_h")
# BERT (masked-LM, tied MLM decoder) under FSDP 2 and, in the same 2-process launch, TP 2 + sequence parallel.
FAMILIES["bert"] = FAMILIES["bert_tp"] = models.get_spec("bert")
# BERT on Megatron's BERT data (token types, padding mask, MLM + sentence order), 1 process and PP 2 (the 2-process
# launch): the data is preprocessed by the reference phase into ROOT/bert_data (tests/unit/masked_data_helpers.py).
FAMILIES["bert_sop"] = FAMILIES["bert_pp"] = models.get_spec("bert")
# bert_sop also runs under FSDP 2 in the 2-process launch: its validation metrics reduced over 2 data ranks.
# ... and TP 2 + sequence parallel with the binary head (the pooler's first token gathered from the shards).
FAMILIES["bert_sop_tp"] = models.get_spec("bert")
# T5 (encoder-decoder, span corruption): the same two layouts, cross-attention included under TP.
FAMILIES["t5"] = FAMILIES["t5_tp"] = models.get_spec("t5")
# ViT (images + class labels, its own objective, on the synthetic shapes set) the same two ways.
FAMILIES["vit"] = FAMILIES["vit_tp"] = models.get_spec("vit")
# LLaVA (a ViT tower, the projector, a Llama; images spliced at placeholder runs) on shapes_captions, under FSDP.
FAMILIES["llava"] = models.get_spec("llava")
TP_FAMILIES = ("bert_tp", "t5_tp", "bert_sop_tp", "vit_tp")
# a loader row is one 24x24 RGB image (1728 bytes): 9 patches + the class token, which sequence parallel cuts
# evenly over 2 ranks; the null tokenizer: no text to read
VIT = {"model": {"name": "vit", "flavor": "debugmodel", "vocab_size": 256, "args": {"image_size": 24}},
       "training": {"seq_len": 3 * 24 * 24},
       "data": {"dataset": "shapes", "tokenizer": "", "tokenizer_type": "NullTokenizer", "builtin_vocab_size": 256}}
EXTRA = {"nemotron_h": {"model": {"flavor": "debugmodel"}, "data": {"document_masking": True},
                        "activation_checkpoint": {"mode": "full"}},
         # masked-LM masks with a spare row past the builtin tokenizer's 2048 tokens (its mask_token_id -1)
         "toy_encoder": {"model": {"vocab_size": 2056}},
         "bert": {"model": {"flavor": "debugmodel", "vocab_size": 2056}},
         "bert_tp": {"model": {"name": "bert", "flavor": "debugmodel", "vocab_size": 2056}},
         # 100 sentinel rows past the builtin tokenizer's 2048 tokens (the flavor's sentinel_top -1)
         "t5": {"model": {"flavor": "debugmodel", "vocab_size": 2148}},
         "t5_tp": {"model": {"name": "t5", "flavor": "debugmodel", "vocab_size": 2148}},
         "vit": VIT, "vit_tp": VIT,
         # a row: one 32x32 RGB image (3072 bytes), then 16 placeholders, the caption and padding (32 tokens)
         "llava": {"model": {"flavor": "debugmodel", "vocab_size": 64}, "training": {"seq_len": 3072 + 32},
                   "data": {"dataset": "shapes_captions", "tokenizer": "", "tokenizer_type": "NullTokenizer",
                            "builtin_vocab_size": 64}}}
TP_ONLY = {"parallelism": {"dp_shard": 1, "tp": 2}}  # bert_tp's and t5_tp's layout under 2 processes
# bert_sop_tp's: the sentence-order loss does not go with loss parallel (models/bert/__init__.py's check)
TP_SOP = {"parallelism": {"dp_shard": 1, "tp": 2, "enable_loss_parallel": False}}
PP_ONLY = {"parallelism": {"dp_shard": 1, "pp": 2, "pp_schedule": "1F1B", "pp_microbatches": 2}}  # bert_pp's
# Validation at the last step on the held-out split, with the family's own metrics (BERT: MLM loss and accuracy,
# sentence-order accuracy; T5: token accuracy), reduced over the data ranks: 2 batches of LOCAL_BATCH on one process
# are the 4 rows one batch covers on 2 data ranks (the loader hands out global positions), so both score the same rows.
VALIDATED = ("bert", "bert_tp", "t5", "t5_tp", "bert_sop", "bert_pp", "bert_sop_tp")
# The 2-process runs also carry the plan's other steps, each held to the plain one-process run like the layout:
# activation checkpointing (full, and per-op selective) and per-block compile (aot_eager: dynamo's and AOTAutograd's
# graphs without Inductor's slow CPU code generation; the optimizer's compile is Inductor's, so "model" only).
# nemotron_h's reference keeps its full AC (EXTRA); its 2-process run uses per-op selective AC instead.
AC_FULL = {"activation_checkpoint": {"mode": "full"}}
AC_OP = {"activation_checkpoint": {"mode": "selective", "selective_option": "op"}}
COMPILE = {"compile": {"enable": True, "backend": "aot_eager", "components": ["model"]}}
LAYOUT = {"bert": {**AC_OP, **COMPILE}, "bert_tp": AC_FULL, "t5": {**AC_FULL, **COMPILE}, "t5_tp": AC_OP,
          "vit": {**AC_OP, **COMPILE}, "vit_tp": AC_FULL, "llava": {**AC_FULL, **COMPILE}, "nemotron_h": AC_OP}
# Checkpoint resharding: a resumed run -> (the run whose step RESHARD_AT it loads, its own layout's family entry),
# through the Trainer's checkpoint manager (checkpoint.initial_load_path with the full state: weights, optimizer,
# LR schedule, data position, RNG); it runs steps RESHARD_AT + 1 and + 2, which must equal the uninterrupted
# one-process run's. FSDP 2 -> TP 2, TP 2 -> FSDP 2, and one process -> TP 2 / FSDP 2 (the reference phase saves).
RESHARD_AT = 5
# The resumed runs' AC / compile: their layout entry's (LAYOUT) unless named here: LLaVA's per-op selective AC (its
# uninterrupted run has full AC and compile), T5 without AC or compile (compile costs a second or two per run).
RESHARD = {"bert_reshard": ("fsdp_bert", "bert_tp", None), "t5_reshard": ("fsdp_t5_tp", "t5", {}),
           "vit_reshard": ("reference_vit", "vit_tp", None), "llava_reshard": ("reference_llava", "llava", AC_OP)}
SAVED = {"fsdp": ("bert", "t5_tp"), "reference": ("vit", "llava")}  # the runs that save step RESHARD_AT, per phase
# Gradients are compared at step 1 and, for these families (the reference phase saves them), at the step after the
# reshard: the resumed runs' first.
GRAD_STEPS = {"bert": (1, RESHARD_AT + 1), "t5": (1, RESHARD_AT + 1), "vit": (1, RESHARD_AT + 1),
              "llava": (1, RESHARD_AT + 1)}
# The one-process run each run's gradients and losses are held to (its own family's unless named here).
REF_OF = {"bert_tp": "bert", "t5_tp": "t5", "vit_tp": "vit", "bert_pp": "bert_sop", "bert_sop_tp": "bert_sop"}


def bert_data(root: str) -> dict:
    """The BERT-data runs' model and data sections (ROOT/bert_data, written by the reference phase)."""
    folder = os.path.join(root, "bert_data")
    return {"model": {"name": "bert", "flavor": "debugmodel", "args": {"binary_head": True, "mask_token_id": 5}},
            "data": {"dataset": "bert", "paths": [os.path.join(folder, "c_text_sentence")],
                     "tokenizer_type": "BertWordPieceLowerCase", "vocab_file": os.path.join(folder, "vocab.txt"),
                     "vocab_extra_ids": 100, "binary_head": True}}

from llava_cases import check_grads  # noqa: E402  (tests/multiproc, beside this file)
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

from titanlike.config.load import config_from_dict  # noqa: E402
from titanlike.config.validate import validate  # noqa: E402
from titanlike.observe.log import setup_logging  # noqa: E402
from titanlike.train.trainer import Trainer  # noqa: E402

STEPS = 10
SEQ = 32
LOCAL_BATCH = 2
GLOBAL_BATCH = 4  # the 1-process reference accumulates 2 micro-batches of 2; FSDP 2 takes 2 per rank


def make_cfg(root: str, name: str, *, family: str = "toy", seed: int = 0, checkpoint: dict | None = None,
             layout: dict | None = None):
    """`layout`: the 2-process run's AC / compile sections instead of LAYOUT's for `family`."""
    base = {
        "job": {"dump_folder": root, "run_name": name},
        "model": {"name": family, "flavor": "tiny"},  # vocab from the tokenizer
        "training": {"steps": STEPS, "seq_len": SEQ, "local_batch_size": LOCAL_BATCH,
                     "global_batch_size": GLOBAL_BATCH, "device": "cpu", "gc_freq": 0, "seed": seed,
                     "max_norm": 1.0},
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 2},
        "data": {"dataset": "stdlib", "tokenizer": "builtin"},  # real text: the loss has something to learn
        "metrics": {"log_freq": 1, "enable_tensorboard": False},
        "parallelism": {"dp_shard": -1},
        "checkpoint": checkpoint or {},
    }
    extra = {**EXTRA.get(family, {}), **(TP_ONLY if family in TP_FAMILIES and int(os.environ.get("WORLD_SIZE", "1")) > 1
                                         else {})}
    if family in ("bert_sop", "bert_pp", "bert_sop_tp"):
        layout = {"bert_pp": PP_ONLY, "bert_sop_tp": TP_SOP}.get(family, {})
        extra = {**bert_data(root), **layout}
    if family in VALIDATED:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dp = 1 if family in (*TP_FAMILIES, "bert_pp") else world
        extra["validation"] = {"enable": True, "interval": STEPS, "steps": 2 // dp}
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1
    layout = LAYOUT.get(family, {}) if layout is None else layout
    for section, values in [*extra.items(), *(layout.items() if multi else ())]:
        base[section] = {**base.get(section, {}), **values}
    cfg = config_from_dict(base)
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # the config loader's rules, as load_config applies them
    return cfg


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def finish(trainer: Trainer) -> None:
    """End a run without destroying the process group (the next Trainer of this process reuses it)."""
    trainer.close(keep_process_group=True)  # heartbeat stopped too; a resume in the same run folder follows


def seed_path(root: str, family: str = "toy") -> str:
    return os.path.join(root, f"seed_{family}", "checkpoint")


def check_fsdp_layout(trainer: Trainer) -> None:
    """The toy plan ran: every parameter a DTensor sharded over the 2 ranks, one FSDP group per block, the
    embeddings and the head in their own groups."""
    model = trainer.model
    assert isinstance(model, FSDPModule), type(model)
    for name in ("wte", "ln_f"):  # the first module of each list group carries the FSDP state
        assert isinstance(getattr(model, name), FSDPModule), name
    assert all(isinstance(b, FSDPModule) for b in model.layers.values())
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device_mesh.size() == 2, n


def check_grads_at_steps(trainer: Trainer, root: str, phase: str, family: str) -> dict:
    """Before the clip of each of GRAD_STEPS' steps (step 1 only by default): the reference phase saves every
    gradient (ROOT/grads/<family>-<step>.pt); a 2-process run holds each of its parameters' gradients, gathered whole,
    to that file's (llava_cases.check_grads: within 1e-5 elementwise; a pipeline rank checks its own stage's).
    Returns what it found (the steps checked, the worst difference, the largest reference gradient), filled as the
    run goes."""
    ref_family = REF_OF.get(family, family)
    found: dict = {"grad_steps": [], "grad_diff": 0.0, "grad_scale": 0.0, "grads_checked": 0}
    clip = trainer.update.clip

    def check_then_clip(*args, **kwargs):
        path = os.path.join(root, "grads", f"{ref_family}-{trainer.step}.pt")
        if trainer.step in GRAD_STEPS.get(ref_family, (1,)):
            # every name of a tied parameter: a pipeline's last stage holds its own copy of BERT's tied decoder
            named = [np for part in trainer.model_parts for np in part.named_parameters(remove_duplicate=False)]
            if phase == "reference":
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save({n: p.grad.detach().clone() for n, p in named if p.grad is not None}, path)
            else:
                worst, scale = check_grads(f"{phase}_{family} step {trainer.step}", named, torch.load(path))
                found["grad_steps"].append(trainer.step)
                found["grad_diff"] = max(found["grad_diff"], worst)
                found["grad_scale"] = max(found["grad_scale"], scale)
                found["grads_checked"] += len(named)
        return clip(*args, **kwargs)

    trainer.update.clip = check_then_clip
    return found


def train(root: str, name: str, expect_fsdp: bool, family: str = "toy", seeded: bool = True,
          checkpoint: dict | None = None, stop_after: int | None = None,
          layout: dict | None = None) -> tuple[dict, Trainer]:
    """One run of `family` (from its seed checkpoint when `seeded`, else from seeded_init's weights); `stop_after`:
    the last step (the LR schedule keeps training.steps)."""
    torch._dynamo.reset()  # compiled runs: the earlier runs' graphs would count against dynamo's recompile limit
    lines = _Lines()
    logging.getLogger("titanlike").addHandler(lines)
    ckpt = {**({"initial_load_path": seed_path(root, family)} if seeded else {}), **(checkpoint or {})}
    trainer = Trainer(make_cfg(root, name, family=family, checkpoint=ckpt, layout=layout))
    if stop_after is not None:
        trainer.cfg.training.steps = stop_after
    grads = check_grads_at_steps(trainer, root, name.split("_")[0], family)
    spec = FAMILIES[family]
    try:
        args = trainer.model_args
        # The trainer read the family only through its spec: the spec, its args class and its counts.
        assert trainer.spec is spec and type(args) is spec.args_cls, (trainer.spec, type(args))
        if family != "bert_pp":  # (PP: no whole model, its stages in model_parts)
            assert isinstance(trainer.model, spec.model_cls), type(trainer.model)  # (FSDP subclasses it)
        seq = trainer.cfg.training.seq_len  # SEQ but for vit (a row is one image)
        assert trainer.flops_per_token == spec.flops_per_token(args, seq) == trainer.metrics.flops_per_token
        assert trainer.dims.fsdp_enabled == (expect_fsdp and family not in (*TP_FAMILIES, "bert_pp"))
        if expect_fsdp and family == "toy":
            check_fsdp_layout(trainer)
        history = trainer.train()
    finally:
        finish(trainer)
        logging.getLogger("titanlike").removeHandler(lines)
    counts = spec.param_counts(args)
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for part in trainer.model_parts
                for p in part.parameters())
    return {
        "history": history,
        "args": {k: getattr(args, k, None) for k in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len")},
        "counts": {"total": counts.total, "active": counts.active, "embedding": counts.embedding},
        "flops_per_token": trainer.flops_per_token,
        "spec_flops_per_token": spec.flops_per_token(args, trainer.cfg.training.seq_len),
        "local_params": local,
        "validation": trainer.last_validation,
        "log": lines.lines,
        **grads,
    }, trainer


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


FROZEN = {"patch_embed.proj.weight", "patch_embed.proj.bias"}


def patch_sums(trainer: Trainer) -> dict[str, float]:
    """Sums of the vision model's patch parameters (the frozen projection, the trained position table): whole
    tensors on every rank (a collective under FSDP)."""
    return {n: float(_full(p.detach()).double().sum()) for n, p in trainer.model.named_parameters()
            if n.startswith("patch_embed.")}


def optimizer_sum(trainer: Trainer) -> float:
    """Sum of every Adam moment: equal after a resume that loaded the optimizer state."""
    from titanlike.optim.container import optimizers_of

    return float(sum(_full(v).double().sum() for o in optimizers_of(trainer.optimizer) for st in o.state.values()
                     for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")))


def check_frozen(trainer: Trainer, fsdp: bool) -> None:
    """The frozen projection: still frozen after the plan (sharded like the rest under FSDP), and neither in the
    optimizer's groups nor in its state after training."""
    from titanlike.optim.container import optimizers_of

    named = dict(trainer.model.named_parameters())
    assert {n for n, p in named.items() if not p.requires_grad} == FROZEN, named.keys()
    opts = optimizers_of(trainer.optimizer)
    in_groups = {id(p) for o in opts for g in o.param_groups for p in g["params"]}
    in_state = {id(p) for o in opts for p in o.state}
    assert {n for n, p in named.items() if id(p) in in_groups} == set(named) - FROZEN
    assert {n for n, p in named.items() if id(p) in in_state} == set(named) - FROZEN
    if fsdp:
        assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in named.values())


def saved_keys(step_dir: str) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return sorted(FileSystemReader(step_dir).read_metadata().state_dict_metadata)


def run_families(root: str, phase: str, fsdp: bool) -> dict:
    out = {}
    runs = (("toy", True), ("toy_encoder", False), ("toy_vision", True), ("nemotron_h", False), ("bert", False),
            ("t5", False), ("vit", False), ("llava", False))
    runs += ((("bert_tp", False), ("t5_tp", False), ("bert_sop", False), ("bert_pp", False), ("bert_sop_tp", False),
              ("vit_tp", False))
             if fsdp else
             (("bert_sop", False),))
    for family, seeded in runs:
        name = phase if family == "toy" else f"{phase}_{family}"
        save = {"enable": True, "interval": STEPS} if fsdp and family == "toy_vision" else None
        reshard_source = {"enable": True, "interval": RESHARD_AT} if family in SAVED[phase] else None
        run, trainer = train(root, name, expect_fsdp=fsdp, family=family, seeded=seeded,
                             checkpoint=save or reshard_source)
        if family == "toy_vision":
            check_frozen(trainer, fsdp)
            run["patch_sums"] = patch_sums(trainer)
        if save:  # the frozen weights are model state; the optimizer state has none of them; a resume loads both
            step_dir = os.path.join(root, name, "checkpoint", f"step-{STEPS}")
            run["saved_keys"] = saved_keys(step_dir)
            before = optimizer_sum(trainer)
            resumed = Trainer(make_cfg(root, name, family=family, checkpoint={**save, "initial_load_path": ""}))
            try:
                assert resumed.train() == [] and resumed.step == STEPS, resumed.step  # loaded the last step
                run["resumed_patch_sums"] = patch_sums(resumed)
                assert optimizer_sum(resumed) == before, (optimizer_sum(resumed), before)
                check_frozen(resumed, fsdp)
            finally:
                finish(resumed)
        out[family] = run
    if fsdp:
        for name, (source, family, layout) in RESHARD.items():
            step_dir = os.path.join(root, source, "checkpoint", f"step-{RESHARD_AT}")
            load = {"initial_load_path": step_dir, "initial_load_model_only": False}
            out[name], _ = train(root, f"{phase}_{name}", expect_fsdp=fsdp, family=family, seeded=False,
                                 checkpoint=load, stop_after=RESHARD_AT + 2, layout=layout)
    return out


def main() -> None:
    root, phase = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    setup_logging()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out = {"world": world}
    if phase == "reference":
        assert world == 1, world
        # another init seed than the runs': a run that failed to load the seed would show it in its loss
        for family in ("toy", "toy_vision"):
            seed = Trainer(make_cfg(root, f"seed_{family}", family=family, seed=1,
                                    checkpoint={"create_seed_checkpoint": True}))
            try:
                if family == "toy_vision":
                    out["vision_seed_sums"] = patch_sums(seed)
                seed.checkpointer.save_seed()
            finally:
                finish(seed)
        from tests.unit.masked_data_helpers import preprocess

        os.makedirs(os.path.join(root, "bert_data"))
        preprocess(Path(root) / "bert_data")  # the BERT-data runs' sentence-split corpus and vocab.txt
        out["runs"] = run_families(root, phase, fsdp=False)
    elif phase == "fsdp":
        assert world == 2, world
        out["runs"] = run_families(root, phase, fsdp=True)
        t = torch.tensor([out["runs"]["toy"]["local_params"]])
        torch.distributed.all_reduce(t)
        out["local_params_all_ranks"] = int(t.item())
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(root, f"{phase}.json"), "w") as f:
            json.dump(out, f)
    from titanlike.distributed.init import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":  # the async checkpoint writer (spawn) would re-import this file: run nothing then
    main()
    # Skip interpreter teardown after a clean finish: on this torch/gloo a background thread occasionally aborts it
    # ("terminate called without an active exception"), turning a passed run into a failure.
    sys.stdout.flush()
    os._exit(0)
