"""The run's model for the memory estimate, built through the trainer's own construction path
(titanlike/train/construct.py: build_model, the plan, materialise; then the Updater), without data, metrics or
checkpoints. Runs inside the fake world of titanlike/planner/fake.py.

Under PP the estimate builds this pp rank's stage modules itself with parallelize/pp.py's own split (model_layout,
stage_module): PipelineRunner also builds the schedule, which needs its peers to run; the stages' modules, plan and
optimizer are the same.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

import models
from parallelize import get_plan
from titanlike.train.batch import BatchLayout
from titanlike.train.construct import build_model, materialise, run_vocab
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
    """The run's vocabulary size as the trainer computes it (run_vocab); the flavor's when the tokenizer's files are
    not here."""
    try:
        from titanlike.data.tokenizers import build_tokenizer

        tok = build_tokenizer(cfg.data)
        vocab, eod = tok.vocab_size, tok.eod_id
    except Exception as e:  # (tokenizer files on another machine) the flavor's vocabulary is the usual one
        vocab, eod = spec.flavor_args(cfg.model.flavor).vocab_size, None
        notes.append(f"tokenizer not loadable here ({type(e).__name__}): vocabulary {vocab} from the flavor")
    return run_vocab(cfg.model, vocab), eod


def build(cfg, dims, device: torch.device, stage: int | None = None, mode=None) -> Built:
    """The model parts, their plan and the Updater, as the Trainer builds them. stage: this pp rank under PP. mode:
    a FakeTensorMode entered from materialisation on (the meta model and the plan are built outside it) and left
    entered (the caller exits it after the trace)."""
    notes: list[str] = []
    vocab, eod = vocab_and_eod(cfg, models.get_spec(cfg.model.name), notes)
    # eod 0 where the tokenizer is elsewhere: the layout's document options still trace their extra inputs
    mb = build_model(cfg, dims, device, vocab, eod if eod is not None else 0, compile_loss_chunk=False)
    plan = get_plan(cfg.model.name, cfg.model.plan)
    if stage is not None:  # this pp rank's stages, each its modules of the whole model under the plan
        from parallelize.pp import model_layout, stage_module

        stages = model_layout(mb.model, mb.spec, mb.model_args, cfg.parallelism, cfg.training.seq_len)
        top = (*mb.spec.input_modules, *mb.spec.output_modules)
        parts = [plan(stage_module(mb.model, stages[sid], top), dims, cfg)
                 for sid in stage_ids(stage, stages, dims, cfg)]
    else:
        parts = [plan(mb.model, dims, cfg)]
    if mode is not None:
        mode.__enter__()
    materialise(parts, device, cfg.training.seed, fake=mode is not None)
    update = Updater(cfg, dims, device, parts)
    return Built(mb.spec, mb.model_args, parts, update, mb.batch_layout, mb.objective, mb.float8, mb.loss_head, notes)


def stage_ids(pp_rank: int, layout: list, dims, cfg) -> list[int]:
    """The stages pp rank `pp_rank` holds (parallelize/pp_split.py's owners)."""
    from parallelize.pp_split import V_SCHEDULES, stage_owners

    owners = stage_owners(dims.pp, len(layout), cfg.parallelism.pp_schedule in V_SCHEDULES)
    return [s for s, owner in enumerate(owners) if owner == pp_rank]
