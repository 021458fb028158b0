"""One construction path for a run's model: the Trainer and the memory estimate (titanlike/planner/build.py) both
build through these functions, so the estimate traces what the run builds, in the same order:

    vocabulary -> the spec's args (flavor, model.args, run fields) -> config checks -> objective -> meta model ->
    batch layout and mask kernel -> FA4, fla -> float8 swap -> LoRA swap -> chunked-loss head (build_model)
    -> the plan (whole model, or pipeline stages) ->
    materialise and initialise                                                   (materialise)

Only the plan step differs: the trainer's PipelineRunner also builds the schedule, which needs its peers; the
estimate builds the same stage modules without it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from unittest import mock

import torch

import float8
import models
from models.batch import build_objective
from models.common.backends import mask_kernel, repeats_kv_heads, wants_fa4, wants_fla
from titanlike.config.errors import ConfigError
from titanlike.config.sections import Checkpoint, Data, Float8, JobConfig, Lora, Model, Parallelism, Training
from titanlike.config.validate import validate_model
from titanlike.config.validate_lora import lora_model_problems
from titanlike.train.batch import BatchLayout
from titanlike.train.loss import apply_chunked_loss

logger = logging.getLogger("titanlike")


@dataclasses.dataclass
class ModelBuild:
    spec: object
    model_args: object
    model: torch.nn.Module  # on the meta device, float8- and loss-head-swapped, not yet parallelized
    objective: object  # the spec's objective (models/batch.py): loader batch -> Batch
    batch_layout: BatchLayout
    float8: object  # float8.convert's handle (post_optimizer_hook)
    loss_head: object | None  # the chunked-loss LM head (training.loss_chunk_tokens > 0)
    lora: dict | None = None  # lora.enable: its settings and the adapted Linears' FQNs (for checkpoints' meta.json)


def run_vocab(model_cfg: Model, tokenizer_vocab: int) -> int:
    """model.vocab_size, else the tokenizer's padded to model.vocab_pad_multiple (Megatron's vocabulary padding)."""
    if model_cfg.vocab_size > 0:
        return model_cfg.vocab_size
    pad = model_cfg.vocab_pad_multiple
    return -(-tokenizer_vocab // pad) * pad


@dataclasses.dataclass(frozen=True)
class BuildSections:
    """The config sections build_model reads, built once by its caller (`BuildSections.of(cfg)`)."""
    model: Model
    training: Training  # seq_len (the args' max_seq_len), loss_chunk_tokens
    parallelism: Parallelism  # the family's checks (heads by TP, ...) and the pipeline's stages against the layers
    data: Data  # document masking and position resets: what each model call takes (BatchLayout)
    float8: Float8
    lora: Lora | None = None  # LoRA adapters swapped in (lora.enable): models/common/lora.py

    @classmethod
    def of(cls, cfg: JobConfig) -> BuildSections:
        return cls(cfg.model, cfg.training, cfg.parallelism, cfg.data, cfg.float8, cfg.lora)


def build_model(sections: BuildSections, dims, device: torch.device, vocab: int, eod_id: int | None, *,
                compile_loss_chunk: bool) -> ModelBuild:
    """Everything before the plan, on the meta device. `vocab`: run_vocab's; `eod_id`: the tokenizer's."""
    t, m, data = sections.training, sections.model, sections.data
    spec = models.get_spec(m.name)
    flavor = spec.flavor_args(m.flavor, m.args)
    n_layers = m.n_layers if m.n_layers > 0 else flavor.n_layers
    run = dict(vocab_size=vocab, max_seq_len=t.seq_len, n_layers=n_layers)  # every family's args have these
    if "repeat_kv_heads" in {f.name for f in dataclasses.fields(flavor)}:  # a kernel knob of GQA families
        run["repeat_kv_heads"] = repeats_kv_heads(m.attn_backend, device)
    model_args = dataclasses.replace(flavor, **run)
    validate_model(spec, model_args, sections.parallelism, m.flavor)
    objective = build_objective(spec.objective, model_args)
    problem = getattr(objective, "data_problem", lambda data: None)(data)  # a head the data has no label for
    if problem:
        raise ConfigError(problem)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    # Packed documents and context parallel: what each rank's model call takes (titanlike/train/batch.py), and the
    # kernel of their masked attention (models/common/masks.py).
    layout = BatchLayout(dims, data, eod_id)
    layout.check_model(model)
    if hasattr(model, "mask_kernel"):
        model.mask_kernel = mask_kernel(m.mask_kernel, data.document_masking or dims.cp_enabled, device)
    if wants_fa4(m.attn_backend, device):  # before compile traces the attention modules
        from models.common.fa4 import use_fa4

        n = use_fa4(model, encoders=m.attn_backend == "fa4")
        logger.info(f"attention: FlashAttention-4 in {n} modules (model.attn_backend)")
    _mixer_kernels(model, m.mixer_kernel, device)
    # Module swaps before the plan wraps the modules; both keep every FQN (checkpoints don't notice).
    f8 = float8.convert(model, sections.float8, fsdp_enabled=dims.fsdp_enabled, model_keep=spec.float8_keep)
    lora = _apply_lora(model, sections.lora, spec.output_modules[-1] if t.loss_chunk_tokens > 0 else None)
    loss_head = (apply_chunked_loss(model, t.loss_chunk_tokens, compile_chunk=compile_loss_chunk,
                                    head_name=spec.output_modules[-1]) if t.loss_chunk_tokens > 0 else None)
    return ModelBuild(spec, model_args, model, objective, layout, f8, loss_head, lora)


def _apply_lora(model, lora: Lora | None, head: str | None) -> dict | None:
    """lora.enable: the base frozen, the targeted Linears swapped for LoraLinear (same FQNs: the base checkpoint
    loads as before); the targets checked against this model first (ConfigError, one line each). Returns the
    settings and the adapted FQNs, or None."""
    if lora is None or not lora.enable:
        return None
    from models.common.lora import apply_lora

    problems = lora_model_problems(model, lora, head)
    if problems:
        raise ConfigError("\n".join(problems))
    swapped = apply_lora(model, list(lora.target_modules), lora.rank, lora.alpha, lora.dropout, lora.include_experts)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(f"LoRA rank {lora.rank}, alpha {lora.alpha}: adapters on {len(swapped)} Linear layers, "
                f"{trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.2f}%); the rest frozen")
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
            "target_modules": list(lora.target_modules), "modules": swapped}


def lora_checkpointing(lora: Lora, ckpt: Checkpoint, built: dict | None) -> dict:
    """CheckpointManager's LoRA arguments: adapter-only steps (lora.save_adapter_only), adapters an initial_load_path
    lacks keep their init, and meta.json's "lora" entry (settings, adapted FQNs, the base's path) for the export."""
    if built is None:
        return {}
    from models.common.lora import is_adapter_key

    base = os.path.abspath(ckpt.initial_load_path) if ckpt.initial_load_path else ""
    return {"trainable_only": lora.save_adapter_only, "fresh": is_adapter_key,
            "meta_extra": {"lora": {**built, "adapter_only": lora.save_adapter_only, "base": base}}}


def _mixer_kernels(model, name: str, device: torch.device) -> None:
    """The recurrent mixers' scans (model.mixer_kernel): fla's kernels where wanted and possible, one log line either
    way when the model has such mixers (before compile traces them)."""
    from models.common.fla_kernels import FLA_SCANS, use_fla

    if not any(getattr(mod, "scan_fn", None) in FLA_SCANS for mod in model.modules()):
        return
    fla, why_not = wants_fla(name, device)
    if not fla:
        if why_not is not None:  # "auto" without a GPU or fla-core: say so once (with the fix where there is one)
            logger.info(f"recurrent mixers: PyTorch chunked scans, not fla's kernels ({why_not})")
        return
    n, skipped = use_fla(model, strict=name == "fla")
    if n == 0:  # every mixer refused here (e.g. Hopper with a Triton that miscompiles fla's backward)
        logger.info(f"recurrent mixers: PyTorch chunked scans in {len(skipped)} modules, not fla's kernels "
                    f"({skipped[0]})")
        return
    logger.info(f"recurrent mixers: flash-linear-attention's kernels in {n} modules (model.mixer_kernel)"
                + (f"; PyTorch in {len(skipped)}: {skipped[0]}" if skipped else ""))


def materialise(parts: list, device: torch.device, seed: int, fake: bool = False) -> None:
    """Each part's storage on `device` and its initial weights: seeded per parameter, so every layout starts from the
    same weights (titanlike/distributed/seeded_init.py). fake: under FakeTensorMode (the estimate), where tensors hold
    no values: init runs for its buffers and shapes only."""
    from models.common.lora import init_adapters
    from titanlike.distributed.seeded_init import seeded_init

    for part in parts:
        _to_empty(part, device) if fake else part.to_empty(device=device)
        with torch.no_grad(), (_no_trunc_normal() if fake else seeded_init(part, seed)):
            part.init_weights(buffer_device=device)
            init_adapters(part)  # LoRA's adapters, which the family's init_weights does not know (A random, B 0)
        part.train()


def _no_trunc_normal():
    # trunc_normal_'s rejection loop reads values, which fake tensors do not have.
    return mock.patch.object(torch.nn.init, "trunc_normal_", lambda tensor, *a, **k: tensor)


def _to_empty(part: torch.nn.Module, device: torch.device) -> None:
    """part.to_empty(device=device) under FakeTensorMode: a plain (meta) parameter is replaced by a new empty one
    instead of by empty_like of it: fake-converting the meta parameter would leave a weak reference on it, and the
    module's parameter swap refuses tensors with weak references. (DTensor parameters convert their local tensor.)"""
    from torch.distributed.tensor import DTensor

    part._apply(lambda t: torch.empty_like(t, device=device) if isinstance(t, DTensor) else
                torch.empty(t.shape, dtype=t.dtype, device=device))


__all__ = ["BuildSections", "ModelBuild", "build_model", "lora_checkpointing", "materialise", "run_vocab"]
