"""The run's model for the memory estimate, built through the trainer's own construction path
(titanlike/train/construct.py: build_model, the plan, materialise; then the Updater), without data, metrics or
checkpoints. Runs inside the fake world of titanlike/planner/fake.py.

Under PP the estimate builds this pp rank's stage modules itself with parallelize/pp.py's own split (model_layout,
stage_module): PipelineRunner also builds the schedule, which needs its peers to run; the stages' modules, plan and
optimizer are the same.

`build` takes the whole JobConfig: it builds a whole run (as the Trainer does), handing each builder its sections.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

import models
from parallelize import PlanSections, get_plan
from titanlike.config.sections import Data, JobConfig, Model
from titanlike.train.batch import BatchLayout
from titanlike.train.construct import BuildSections, build_model, materialise, run_vocab
from titanlike.train.update import UpdateSections, Updater

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


def vocab_and_eod(model_cfg: Model, data: Data, spec, notes: list[str]) -> tuple[int, int | None]:
    """The run's vocabulary size as the trainer computes it (run_vocab); the flavor's when the tokenizer's files are
    not here."""
    try:
        from titanlike.data.tokenizers import build_tokenizer

        tok = build_tokenizer(data)
        vocab, eod = tok.vocab_size, tok.eod_id
    except Exception as e:  # (tokenizer files on another machine) the flavor's vocabulary is the usual one
        vocab, eod = spec.flavor_args(model_cfg.flavor).vocab_size, None
        notes.append(f"tokenizer not loadable here ({type(e).__name__}): vocabulary {vocab} from the flavor")
    return run_vocab(model_cfg, vocab), eod


def build(cfg: JobConfig, dims, device: torch.device, stage: int | None = None, mode=None) -> Built:
    """The model parts, their plan and the Updater, as the Trainer builds them. stage: this pp rank under PP. mode:
    a FakeTensorMode entered from materialisation on (the meta model and the plan are built outside it) and left
    entered (the caller exits it after the trace)."""
    notes: list[str] = []
    vocab, eod = vocab_and_eod(cfg.model, cfg.data, models.get_spec(cfg.model.name), notes)
    # eod 0 where the tokenizer is elsewhere: the layout's document options still trace their extra inputs
    mb = build_model(BuildSections.of(cfg), dims, device, vocab, eod if eod is not None else 0,
                     compile_loss_chunk=False)
    plan, sections = get_plan(cfg.model.name, cfg.model.plan), PlanSections.of(cfg)
    if stage is not None:  # this pp rank's stages, each its modules of the whole model under the plan
        from parallelize.pp import model_layout, stage_module
        from parallelize.pp_split import V_SCHEDULES, stage_ids

        stages = model_layout(mb.model, mb.spec, mb.model_args, cfg.parallelism, cfg.training.seq_len)
        top = (*mb.spec.input_modules, *mb.spec.output_modules)
        v_shape = cfg.parallelism.pp_schedule in V_SCHEDULES
        parts = [plan(stage_module(mb.model, stages[sid], top), dims, sections)
                 for sid in stage_ids(stage, dims.pp, len(stages), v_shape)]
    else:
        parts = [plan(mb.model, dims, sections)]
    if mode is not None:
        mode.__enter__()
    materialise(parts, device, cfg.training.seed, fake=mode is not None)
    update = Updater(UpdateSections.of(cfg), dims, device, parts, (*mb.spec.input_modules, *mb.spec.output_modules))
    return Built(mb.spec, mb.model_args, parts, update, mb.batch_layout, mb.objective, mb.float8, mb.loss_head, notes)
