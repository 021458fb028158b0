"""torchrun worker for tests/multiproc/test_dist_cp.py: context-parallel layouts against one process.

Every rank builds the one-process reference (the tiny Llama, fp32) and takes its loss and gradients on the whole
batch; then, for each layout named on the command line, builds the model on meta, applies the llama3 plan under that
ParallelDims, loads the reference weights, runs the trainer's batch layout (titanlike/train/batch.py), forward,
the trainer's loss scaling and backward, and compares the loss and every parameter's full gradient.

Layouts: "cp<c>[xdp<d>][xtp<t>][+docs][+pos]" (docs: data.document_masking; pos: data.reset_position_ids).
Prints "CP_OK <layout> loss_diff grad_diff" per layout on rank 0.
"""
from __future__ import annotations

import re
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

import models
from par_helpers import exit_without_teardown
from parallelize import get_plan
from titanlike.config import config_from_dict
from titanlike.distributed.parallel_dims import ParallelDims
from titanlike.train.batch import BatchLayout
from titanlike.train.loss import IGNORE_INDEX, cross_entropy_sum

SEQ, VOCAB, ROWS, EOD = 32, 128, 4, 3
TOL = 1e-5


def model_args(name: str):
    spec = models.get_spec(name)
    if name == "llama3":
        return spec.args_cls(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32,
                             rope_theta=10000.0, max_seq_len=SEQ)
    return __import__("dataclasses").replace(spec.flavor_args("debugmodel"), vocab_size=VOCAB, max_seq_len=SEQ,
                                             n_layers=2)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(4, VOCAB, (ROWS, SEQ + 1), generator=g)
    tokens[tokens % 11 == 0] = EOD  # documents of uneven lengths, some crossing the CP chunk borders
    labels = tokens[:, 1:].clone()
    labels[0, :5] = IGNORE_INDEX  # the global token count is what normalises the loss, not each rank's
    return tokens[:, :-1], labels


def reference(name: str, docs: bool, pos: bool):
    torch.manual_seed(0)
    model = models.get_spec(name).model_cls(model_args(name))
    model.init_weights()
    inputs, labels = batch()
    layout = BatchLayout(SimpleNamespace(get_mesh=lambda _: None),
                         SimpleNamespace(document_masking=docs, reset_position_ids=pos), EOD)
    inputs, labels, kwargs = layout(inputs, labels)
    loss = cross_entropy_sum(model(inputs, **kwargs), labels) / (labels != IGNORE_INDEX).sum()
    loss.backward()
    return model, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def run_layout(spec_name: str, layout: str, ref_model, ref_loss, ref_grads) -> tuple[float, float]:
    m = re.fullmatch(r"cp(\d+)(?:xdp(\d+))?(?:xtp(\d+))?(\+docs)?(\+pos)?", layout)
    cp, dp, tp = int(m[1]), int(m[2] or 1), int(m[3] or 1)
    docs, pos = bool(m[4]), bool(m[5])
    cfg = config_from_dict({"model": {"name": spec_name}, "parallelism": {"cp": cp, "dp_shard": dp, "tp": tp},
                            "training": {"seq_len": SEQ, "device": "cpu"}, "compile": {"enable": False},
                            "activation_checkpoint": {"mode": "none"},
                            "data": {"document_masking": docs, "reset_position_ids": pos}})
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = models.get_spec(spec_name).model_cls(model_args(spec_name))
    model = get_plan(spec_name, "default")(model, dims, cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    set_model_state_dict(model, ref_model.state_dict(), options=StateDictOptions(full_state_dict=True))

    inputs, labels = batch()
    dp_mesh = dims.get_mesh("dp")
    if dp_mesh is not None:  # each data-parallel rank its rows, as the loader would give them
        rows = ROWS // dims.dp_degree
        inputs, labels = (x[dp_mesh.get_local_rank() * rows:][:rows] for x in (inputs, labels))
    inputs, labels, kwargs = BatchLayout(dims, cfg.data, EOD)(inputs, labels)
    tokens = (labels != IGNORE_INDEX).sum().float()
    dist.all_reduce(tokens, group=dims.get_mesh("dp_cp").get_group())
    out = model(inputs, **kwargs)
    if isinstance(out, DTensor):
        out = out.full_tensor()
    loss_sum = cross_entropy_sum(out, labels)
    (loss_sum * dims.dp_cp_degree / tokens).backward()  # the trainer's scaling (titanlike/train/trainer.py)
    total = loss_sum.detach().clone()
    dist.all_reduce(total, group=dims.get_mesh("dp_cp").get_group())
    loss_diff = abs(total / tokens - ref_loss).item()
    grad_diff = 0.0
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grad_diff = max(grad_diff, (g - ref_grads[n]).abs().max().item())
    return loss_diff, grad_diff


def main() -> None:
    dist.init_process_group("gloo")
    spec_name, layouts = sys.argv[1], sys.argv[2:]
    refs = {}
    for layout in layouts:
        key = ("+docs" in layout, "+pos" in layout)
        if key not in refs:
            refs[key] = reference(spec_name, *key)
        loss_diff, grad_diff = run_layout(spec_name, layout, *refs[key])
        if dist.get_rank() == 0:
            print(f"CP_OK {spec_name} {layout} {loss_diff:.3e} {grad_diff:.3e}", flush=True)
        assert loss_diff <= TOL and grad_diff <= TOL, (layout, loss_diff, grad_diff)
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
