"""What a model reads and what it is trained to predict: the typed micro-batch and the objectives that make it.

A data loader yields `(input_ids [B, S], labels [B, S])` (labels = input_ids shifted by one). The family's objective
(`ModelSpec.objective`) turns that into a `Batch`: the model's named inputs and the targets its loss compares the
output with. Everything after that (titanlike/train/batch.py's documents and context-parallel cut, the pipeline
schedule, the forward, the loss and its global normalisation) reads the Batch generically, so a family with other
inputs (token types, encoder and decoder sequences, images) or another objective needs no trainer change.

Lives in models/ (plain torch, no titanlike import) so a family's forward and its own objective can use it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

IGNORE_INDEX = -100  # a target that counts for nothing: neither in the loss nor in the global target count


@dataclass
class Batch:
    """One micro-batch as a model reads it.

    inputs: the forward's arguments by name. `inputs[primary]` is passed positionally (a pipeline's first stage reads
    it; later stages get the previous stage's hidden states in its place), every other entry by keyword, to every
    stage. labels: target class ids, IGNORE_INDEX where there is none; the loss is the summed cross-entropy of the
    output's last dimension against them ([B, S] per token, [B] per sequence), divided by the global count of targets
    (or another summed loss the objective names, titanlike/train/loss.py).
    sequence: the names (of inputs, and "labels") whose dim 1 is the sequence context parallel cuts; everything else
    (whole-sequence document ids, images, per-sequence labels) reaches every CP rank whole.
    extras: per-row tensors (dim 0 = the rows) the loss reads beside the labels, by keyword (DPO's reference
    log-probs); empty for a loss of (output, labels) alone.
    row_targets: [B] how many terms of the summed loss each row holds, where that is not its count of labels !=
    IGNORE_INDEX (DPO sums over pairs: 1 on each pair's chosen row, 0 on its rejected row); what the trainer adds up
    over ranks and micro-batches to normalise the loss (target_count).
    row_aux: [B] the terms each row holds of a second, per-sample part of the loss (BERT's sentence-order term) that
    must be a mean over the step's samples rather than its targets: the trainer sums it over ranks and micro-batches
    in the same all-reduce as the target count and hands every micro-batch's loss `extras["aux_scale"]` (per row,
    all equal) = global targets / global samples (titanlike/train/batch.py: per_sample_scale), so that part comes out
    the same on any layout.
    documents: [B, S] document numbers over `inputs[primary]`, where the objective reads them from its rows (llava's
    packed image-text rows, whose documents no end-of-document token marks); titanlike/train/batch.py then uses them
    for data.document_masking / data.reset_position_ids in place of its search for end-of-document tokens.
    """
    inputs: dict[str, torch.Tensor]
    labels: torch.Tensor
    primary: str = "tokens"
    sequence: tuple[str, ...] = ("tokens", "labels")
    extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    row_targets: torch.Tensor | None = None
    row_aux: torch.Tensor | None = None
    documents: torch.Tensor | None = None

    def args(self) -> tuple[torch.Tensor]:
        return (self.inputs[self.primary],)

    def kwargs(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.inputs.items() if k != self.primary}

    def replace(self, **changes) -> Batch:
        return dataclasses.replace(self, **changes)

    def target_count(self) -> torch.Tensor:
        """The number of terms the loss sums over this batch (a device scalar: nothing waits for the device)."""
        if self.row_targets is None:
            return (self.labels != IGNORE_INDEX).sum()
        return self.row_targets.sum()

    def aux_count(self) -> torch.Tensor | None:
        """The samples of the per-sample part of the loss (row_aux), or None where the loss has none."""
        return None if self.row_aux is None else self.row_aux.sum()

    def split(self, n: int) -> list[Batch]:
        """n batches along dim 0 (the pipeline's micro-batches): inputs, labels, extras and row targets alike."""
        parts = {k: v.tensor_split(n) for k, v in self.inputs.items()}
        extras = {k: v.tensor_split(n) for k, v in self.extras.items()}
        rows = self.row_targets.tensor_split(n) if self.row_targets is not None else [None] * n
        aux = self.row_aux.tensor_split(n) if self.row_aux is not None else [None] * n
        docs = self.documents.tensor_split(n) if self.documents is not None else [None] * n
        return [self.replace(inputs={k: p[i] for k, p in parts.items()}, labels=y,
                             extras={k: p[i] for k, p in extras.items()}, row_targets=rows[i], row_aux=aux[i],
                             documents=docs[i])
                for i, y in enumerate(self.labels.tensor_split(n))]


@dataclass(frozen=True)
class StepContext:
    """Where a batch falls in the run, for objectives that draw something (masks): a function of these and the data
    alone, never of the rank or the micro-batch's place, so a resumed run and any layout see the same batch."""
    step: int  # the training step (0 for validation and evaluation: the same draw every pass)
    seed: int  # training.seed


class Objective(Protocol):
    """How a loader batch becomes a Batch, and which loss trains it. A family names a built-in one in its ModelSpec
    (`objective="masked_lm"`) or gives its own factory `args -> Objective`."""

    # "cross_entropy": summed over targets != IGNORE_INDEX (titanlike/train/loss.py); "dpo": summed over preference
    # pairs (titanlike/train/dpo.py's objective, which wraps NextToken and brings its own loss function)
    loss: str

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> Batch: ...


@dataclass(frozen=True)
class NextToken:
    """Causal LM: predict each next token (the loader's labels as they are)."""
    loss: str = "cross_entropy"

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> Batch:
        return Batch(inputs={"tokens": input_ids}, labels=labels)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit integer hash (splitmix64's finaliser, on int64 with wrap-around; logical shifts emulated by masking)."""
    def shr(v: torch.Tensor, n: int) -> torch.Tensor:
        return (v >> n) & ((1 << (64 - n)) - 1)

    x = (x ^ shr(x, 30)) * -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
    x = (x ^ shr(x, 27)) * -7723592293110705685  # 0x94d049bb133111eb as int64
    return x ^ shr(x, 31)


@dataclass(frozen=True)
class MaskedLM:
    """BERT-style masked LM: a `rate` share of the positions get a target (their own token); of those, a `random`
    share gets a random token of the vocabulary as input, a `keep` share keeps its token, and the rest get `mask_id`
    (BERT's 80/10/10 is random = keep = 0.1; the default 0, 0 masks them all). Every other position has no target.
    The loader's next-token labels are unused.

    Which positions, and what they get: a hash of (seed, step, the row's tokens, the position), on the device, with
    no generator: the same rows at the same step give the same inputs and targets on any layout (a row's place in
    the batch or the rank holding it does not enter) and after a resume. Two identical rows in one step get the
    same mask."""
    mask_id: int
    rate: float = 0.15
    loss: str = "cross_entropy"
    random: float = 0.0
    keep: float = 0.0
    vocab_size: int = 0  # the random tokens' range (needed when random > 0)

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, ctx: StepContext) -> Batch:
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device, dtype=torch.int64)
        row = _mix(input_ids * (2 * pos + 1)).sum(dim=1, keepdim=True)  # depends on every token of the row
        key = _mix(row + _mix(pos + (ctx.seed << 32) + ctx.step * 0x9E3779B9))
        masked = (key & 0xFFFFFF).double() < self.rate * (1 << 24)
        inputs = input_ids.masked_fill(masked, self.mask_id)
        if self.random or self.keep:
            # Independent bits of the same key: 24 more for the 80/10/10 draw, the rest for the random token.
            u = ((key >> 24) & 0xFFFFFF).double() / (1 << 24)
            rand = masked & (u < self.random)
            keep = masked & (u >= self.random) & (u < self.random + self.keep)
            token = ((key >> 48) & 0x7FFF) % self.vocab_size if self.vocab_size <= 0x8000 else \
                _mix(key) % self.vocab_size
            inputs = torch.where(rand, token, torch.where(keep, input_ids, inputs))
        return Batch(inputs={"tokens": inputs}, labels=input_ids.masked_fill(~masked, IGNORE_INDEX))

    def tokenizer_problem(self, tokenizer: Any) -> str | None:
        """Why this mask id cannot work with `tokenizer`, or None: it must be the tokenizer's own mask token, or a
        row past its vocabulary (model.vocab_size / model.vocab_pad_multiple leave spare rows); any other id is a
        real token, which masking would make ambiguous."""
        if self.mask_id >= tokenizer.vocab_size:
            return None
        own = next((i for i in (tokenizer.token_to_id(t) for t in MASK_TOKENS) if i is not None), None)
        if own == self.mask_id:
            return None
        has = f"whose mask token is {own}" if own is not None else f"which has no mask token ({'/'.join(MASK_TOKENS)})"
        return (f"model.args.mask_token_id: the masked_lm objective would mask with token {self.mask_id}, a real "
                f"token of the tokenizer ({tokenizer.vocab_size} tokens) {has}; set model.args.mask_token_id to "
                + (f"{own}" if own is not None else f"-1 and model.vocab_size above {tokenizer.vocab_size} (a "
                   f"spare row)"))


MASK_TOKENS = ("[MASK]", "<mask>")  # BERT's and RoBERTa's mask token texts, looked up in the run's tokenizer


def masked_lm(args: Any) -> MaskedLM:
    """The args' mask_token_id (negative: counted from the end of the vocabulary, a padding row no text uses),
    mask_rate and, where the args have them, mask_random / mask_keep (BERT's 80/10/10)."""
    mask_id = getattr(args, "mask_token_id", -1)
    return MaskedLM(mask_id=mask_id % args.vocab_size, rate=getattr(args, "mask_rate", 0.15),
                    random=getattr(args, "mask_random", 0.0), keep=getattr(args, "mask_keep", 0.0),
                    vocab_size=args.vocab_size)


OBJECTIVES: dict[str, Callable[[Any], Objective]] = {
    "next_token": lambda args: NextToken(),
    "masked_lm": masked_lm,
}


def build_objective(objective: str | Callable[[Any], Objective], args: Any) -> Objective:
    """The objective a ModelSpec names (a key of OBJECTIVES or a factory `args -> Objective`), for these args."""
    if callable(objective):
        return objective(args)
    if objective not in OBJECTIVES:
        raise ValueError(f"ModelSpec.objective={objective!r} unknown; choose one of {sorted(OBJECTIVES)} or give a "
                         f"factory args -> Objective (models/batch.py)")
    return OBJECTIVES[objective](args)


__all__ = ["Batch", "IGNORE_INDEX", "MaskedLM", "NextToken", "OBJECTIVES", "Objective", "StepContext",
           "build_objective"]
