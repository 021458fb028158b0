"""The trainer's model construction, for the memory estimate: the same builders in the same order as
titanlike/train/trainer.py (meta model -> float8 convert -> chunked loss head -> plan -> to_empty -> init ->
Updater), without data, metrics or checkpoints. Runs inside the fake world of titanlike/planner/fake.py.

Under PP the estimate builds this pp rank's stage modules itself with parallelize/pp.py's own split (model_layout,
stage_module): PipelineRunner also builds the schedule, which needs its peers to run; the stages' modules, plan and
optimizer are the same.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

import float8
import models
from models.batch import build_objective
from models.common.backends import mask_kernel, repeats_kv_heads
from parallelize import get_plan
from titanlike.config.validate import validate_model
from titanlike.train.batch import BatchLayout
from titanlike.train.loss import apply_chunked_loss
from titanlike.train.update import Updater

logger = logging.getLogger("titanlike")


@dataclasses.dataclass
class Built:
    spec: object
    model_args: object
    parts: list  # the model parts this rank holds (one without PP)
    update: Updater
    batch_layout: BatchLayout
    objective: object  # the spec's objective (models/batch.py): loader batch -> Batch
    float8: object
    loss_head: object | None  # the chunked-loss LM head (training.loss_chunk_tokens > 0)
    notes: list[str]


def vocab_and_eod(cfg, spec, notes: list[str]) -> tuple[int, int | None]:
    """The run's vocabulary size as the trainer computes it (model.vocab_size, else the tokenizer's padded to
    model.vocab_pad_multiple); the flavor's when the tokenizer's files are not here."""
    pad = cfg.model.vocab_pad_multiple
    try:
        from titanlike.data.tokenizers import build_tokenizer

        tok = build_tokenizer(cfg.data)
        vocab, eod = tok.vocab_size, tok.eod_id
    except Exception as e:  # (tokenizer files on another machine) the flavor's vocabulary is the usual one
        vocab, eod = spec.flavor_args(cfg.model.flavor).vocab_size, None
        notes.append(f"tokenizer not loadable here ({type(e).__name__}): vocabulary {vocab} from the flavor")
    if cfg.model.vocab_size > 0:
        return cfg.model.vocab_size, eod
    return -(-vocab // pad) * pad, eod


def build(cfg, dims, device: torch.device, stage: int | None = None, mode=None) -> Built:
    """The model parts, their plan and the Updater, as the Trainer builds them. stage: this pp rank under PP. mode:
    a FakeTensorMode entered from materialisation on (the meta model and the plan are built outside it) and left
    entered (the caller exits it after the trace)."""
    t, notes = cfg.training, []
    spec = models.get_spec(cfg.model.name)
    vocab, eod = vocab_and_eod(cfg, spec, notes)
    flavor = spec.flavor_args(cfg.model.flavor, cfg.model.args)
    n_layers = cfg.model.n_layers if cfg.model.n_layers > 0 else flavor.n_layers
    run = dict(vocab_size=vocab, max_seq_len=t.seq_len, n_layers=n_layers)
    if "repeat_kv_heads" in {f.name for f in dataclasses.fields(flavor)}:
        run["repeat_kv_heads"] = repeats_kv_heads(cfg.model.attn_backend, device)
    model_args = dataclasses.replace(flavor, **run)
    validate_model(spec, model_args, cfg)
    objective = build_objective(spec.objective, model_args)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    layout = BatchLayout(dims, cfg.data, eod if eod is not None else 0)
    layout.check_model(model)
    if hasattr(model, "mask_kernel"):
        model.mask_kernel = mask_kernel(cfg.model.mask_kernel, cfg.data.document_masking or dims.cp_enabled, device)
    f8 = float8.convert(model, cfg.float8, fsdp_enabled=dims.fsdp_enabled)
    loss_head = (apply_chunked_loss(model, t.loss_chunk_tokens, compile_chunk=False, head_name=spec.output_modules[-1])
                 if t.loss_chunk_tokens > 0 else None)
    plan = get_plan(cfg.model.name, cfg.model.plan)
    if stage is not None:  # this pp rank's stages, each its modules of the whole model under the plan
        from parallelize.pp import model_layout, stage_module

        stages = model_layout(model, spec, model_args, cfg.parallelism, t.seq_len)
        top = (*spec.input_modules, *spec.output_modules)
        parts = [plan(stage_module(model, stages[sid], top), dims, cfg) for sid in stage_ids(stage, stages, dims, cfg)]
    else:
        parts = [plan(model, dims, cfg)]
    from titanlike.distributed.seeded_init import seeded_init

    if mode is not None:
        mode.__enter__()
    for part in parts:
        to_empty(part, device)
        # Fake tensors hold no values: the layout-independent draws (seeded_init) and trunc_normal_'s rejection loop
        # would need some; init runs for its buffers and shapes only.
        with torch.no_grad(), (seeded_init(part, t.seed) if mode is None else _no_trunc_normal()):
            part.init_weights(buffer_device=device)
        part.train()
    update = Updater(cfg, dims, device, parts)
    return Built(spec, model_args, parts, update, layout, objective, f8, loss_head, notes)


def _no_trunc_normal():
    from unittest import mock

    return mock.patch.object(torch.nn.init, "trunc_normal_", lambda tensor, *a, **k: tensor)


def to_empty(part: torch.nn.Module, device: torch.device) -> None:
    """part.to_empty(device=device); under FakeTensorMode a plain (meta) parameter is replaced by a new empty one
    instead of by empty_like of it: fake-converting the meta parameter would leave a weak reference on it, and the
    module's parameter swap refuses tensors with weak references. (DTensor parameters convert their local tensor.)"""
    from torch._guards import active_fake_mode
    from torch.distributed.tensor import DTensor

    if active_fake_mode() is None:
        part.to_empty(device=device)
        return
    part._apply(lambda t: torch.empty_like(t, device=device) if isinstance(t, DTensor) else
                torch.empty(t.shape, dtype=t.dtype, device=device))


def stage_ids(pp_rank: int, layout: list, dims, cfg) -> list[int]:
    """The stages pp rank `pp_rank` holds (parallelize/pp_split.py's owners)."""
    from parallelize.pp_split import V_SCHEDULES, stage_owners

    owners = stage_owners(dims.pp, len(layout), cfg.parallelism.pp_schedule in V_SCHEDULES)
    return [s for s, owner in enumerate(owners) if owner == pp_rank]
