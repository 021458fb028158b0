"""From an objective's Batch (models/batch.py) of whole sequences to one rank's model call: context parallel's share
of the inputs the Batch declares as sequences, and the documents of packed sequences.

Every CP rank of a data-parallel rank reads the same batch (the data shard is the dp index); each keeps its
load-balanced chunks (parallelize/cp.py). With data.document_masking the document ids of the whole sequence go to the
model (attention stays inside documents: models/common/masks.py), and with data.reset_position_ids the RoPE positions
restart at every document, as Megatron's --reset-attention-mask / --reset-position-ids do; data.eod_mask_loss drops
the loss on the end-of-document positions (their target is the next document's first token), as --eod-mask-loss.
Documents are found by their end-of-document token, unless the objective numbers them itself (Batch.documents: llava's
packed image-text rows, titanlike/data/webdataset_pack.py).
"""
from __future__ import annotations

import inspect

import torch

from models.batch import IGNORE_INDEX, Batch
from models.common.masks import document_ids, document_positions
from parallelize.cp import shard_sequence


class BatchLayout:
    def __init__(self, dims, data_cfg, eod_id: int | None):
        mesh = dims.get_mesh("cp")
        self.cp = (mesh.get_local_rank(), mesh.size()) if mesh is not None else None
        self.documents = data_cfg.document_masking
        self.reset_positions = data_cfg.reset_position_ids
        self.eod_mask_loss = data_cfg.eod_mask_loss
        if (self.documents or self.reset_positions or self.eod_mask_loss) and eod_id is None:
            raise ValueError("data.document_masking / data.reset_position_ids / data.eod_mask_loss find documents by "
                             "their end-of-document token, and this tokenizer has none: set data.eod_token (or "
                             "data.eos_token), or turn them off")
        self.eod_id = eod_id
        # Document boundaries seen so far (a device count, read on a log step): zero means every sequence is one
        # document and these options change nothing, which must not pass silently (data without EOD tokens).
        self._boundaries, self._tokens = None, 0
        self._checked = not (self.documents or self.reset_positions or self.eod_mask_loss)

    def check_model(self, model: torch.nn.Module) -> None:
        """A ValueError naming the keys when the model's forward cannot take what this layout hands it."""
        wanted = [k for k, on in (("doc_ids", self.documents), ("positions", self.reset_positions)) if on]
        params = inspect.signature(model.forward).parameters
        missing = [k for k in wanted if k not in params]
        if missing:
            raise ValueError(f"data.document_masking / data.reset_position_ids: {type(model).__name__}.forward takes "
                             f"no {' or '.join(missing)} (models/common/decoder.py's Decoder does); turn them off for "
                             f"this model")

    def __call__(self, batch: Batch, token_ids: torch.Tensor | None = None) -> Batch:
        """A Batch of whole sequences -> this rank's Batch. The document options find documents in `token_ids`, the
        loader's ids (default: the input "tokens"; an objective may have changed those, as masked-LM's mask ids do)
        and add the inputs "doc_ids" / "positions"; context parallel cuts the inputs named in `batch.sequence`."""
        inputs, labels = dict(batch.inputs), batch.labels
        tokens = token_ids if token_ids is not None else inputs.get("tokens")
        if (self.documents or self.reset_positions or self.eod_mask_loss) and tokens is None:
            raise ValueError(f"data.document_masking / data.reset_position_ids / data.eod_mask_loss find documents in "
                             f"token ids, and this objective's batch has none (inputs {sorted(inputs)}): turn them off "
                             f"for this model")
        if self.eod_mask_loss and labels.shape != tokens.shape:
            raise ValueError(f"data.eod_mask_loss drops per-token targets, and this objective's labels are "
                             f"{tuple(labels.shape)} for tokens {tuple(tokens.shape)}: turn it off for this model")
        given = batch.documents  # an objective that reads its rows' documents itself (llava's packed rows)
        if not self._checked:  # an EOD before a sequence's last position starts another document in it
            found = (tokens[:, :-1] == self.eod_id).sum() if given is None else (given[:, 1:] != given[:, :-1]).sum()
            self._boundaries = found if self._boundaries is None else self._boundaries + found
            self._tokens += tokens.numel()
        if self.eod_mask_loss:
            labels = labels.masked_fill(tokens == self.eod_id, IGNORE_INDEX)
        if self.documents or self.reset_positions:
            docs = given if given is not None else document_ids(tokens, self.eod_id)
            if self.documents:
                inputs["doc_ids"] = docs
            if self.reset_positions:
                inputs["positions"] = document_positions(docs)
        if self.cp is not None:
            inputs = {k: shard_sequence(v, *self.cp) if k in batch.sequence else v for k, v in inputs.items()}
            if "labels" in batch.sequence:
                labels = shard_sequence(labels, *self.cp)
        return batch.replace(inputs=inputs, labels=labels)

    def no_documents_warning(self) -> str | None:
        """On a log step (it reads a device count): once, a line naming the keys and the fix when the batches so far
        held no document boundary at all; None otherwise (and every later call is free)."""
        if self._checked or self._boundaries is None:
            return None
        self._checked = True
        if int(self._boundaries.item()) > 0:
            return None
        keys = " / ".join(k for k, on in (("data.document_masking", self.documents), ("data.reset_position_ids",
                          self.reset_positions), ("data.eod_mask_loss", self.eod_mask_loss)) if on)
        verb = "it changes" if " / " not in keys else "they change"
        return (f"{keys} found no end-of-document token (id {self.eod_id}) inside the first {self._tokens} tokens "
                f"of this rank: every sequence is one document, so {verb} nothing; add EOD tokens to the data "
                f"(scripts/preprocess_data.py --append-eod; data.add_eod for text data), set data.eod_token to the "
                f"token that ends your documents, or turn {keys} off (unless your documents are longer than that)")


def per_sample_scale(batches: list[Batch], sum_over_data) -> tuple[list[Batch], torch.Tensor]:
    """The step's global target count (the loss's divisor) and, where the loss has a per-sample part (Batch.row_aux:
    BERT's sentence order), the micro-batches with `extras["aux_scale"]` = global targets / global samples, both
    counts from one all-reduce (`sum_over_data`). The trainer divides the summed loss by the targets, so that part
    becomes a mean over the step's samples: the same on any layout and any split into micro-batches."""
    targets = sum(b.target_count() for b in batches).float()
    if all(b.row_aux is None for b in batches):
        return batches, sum_over_data(targets)
    zero = torch.zeros((), device=targets.device)
    samples = sum((b.aux_count() if b.row_aux is not None else zero) for b in batches).float()
    counts = sum_over_data(torch.stack([targets, samples]))
    ratio = counts[0] / counts[1].clamp(min=1)
    return [b if b.row_aux is None else b.replace(extras={**b.extras, "aux_scale": ratio.expand(len(b.labels))})
            for b in batches], counts[0]
