"""torchrun worker (2 gloo processes, fp32): the DeepSeek-V3 family (MLA, a dense first layer, shared experts,
sigmoid group-limited routing with the expert bias, the sequence-wise balance loss) built through its default plan
under TP 2 (sequence parallel; loss parallel with a plain q projection), FSDP 2 and EP 2 x FSDP 2 (4 of the 8
experts per rank), each against a one-process reference from the same weights: the loss and every gradient of two
steps, and the parameters after two AdamW steps (1e-5). Rank 0 prints "CHECK <name> ok ..." per case. Run by
test_dist_deepseek_v3.py; TITANLIKE_TEST_TP_COMPILE=1 adds a per-block compiled case (minutes of cold inductor)."""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

from models.deepseek_v3 import Transformer
from tests.unit.test_deepseek_v3 import build, tiny_args

CASES = {  # name: (ParallelDims degrees, sequence parallel, loss parallel, q_lora_rank, per-block compile)
    "tp2_sp": ({"tp": 2}, True, False, 24, False),
    "tp2_lp_plain_q": ({"tp": 2}, False, True, 0, False),
    "fsdp2": ({"dp_shard": 2}, True, False, 24, False),
    "ep2": ({"dp_shard": 2, "ep": 2}, True, False, 24, False),
}
COMPILE_CASES = {"tp2_sp_compile": ({"tp": 2}, True, True, 24, True)}
RUN_COMPILE = os.environ.get("TITANLIKE_TEST_TP_COMPILE") == "1"


def _plan_case(name: str, dims_kw: dict, sp: bool, lp: bool, q_lora_rank: int, compile: bool, rank: int,
               world: int) -> str:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from parallelize import PlanSections, get_plan
    from titanlike.config.sections import JobConfig
    from titanlike.distributed.parallel_dims import ParallelDims

    args = tiny_args(q_lora_rank=q_lora_rank, max_seq_len=16, rope_factor=4.0, rope_original_max_position=8,
                     rope_mscale=1.0, rope_mscale_all_dim=1.0)
    args.moe.seq_aux_loss_coeff = 0.01  # its gradient enters the router's: replicated routing must keep it exact
    dims = ParallelDims(**dims_kw, world_size=world)
    dims.build_mesh("cpu")
    cfg = JobConfig()
    cfg.parallelism.enable_sequence_parallel, cfg.parallelism.enable_loss_parallel = sp, lp
    cfg.compile.enable, cfg.compile.components = compile, ["model"]
    ref = build(args, seed=0)
    with torch.no_grad():
        for block in ref.layers.values():
            if block.moe_enabled:
                block.moe.expert_bias.copy_(0.05 * torch.randn(8, generator=torch.Generator().manual_seed(1)))
    with torch.device("meta"):
        model = Transformer(args)
    model = get_plan("deepseek_v3", "default")(model, dims, PlanSections.of(cfg))
    model.to_empty(device="cpu")
    model.init_weights()
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in (ref, model)]
    dp, dp_rank = dims.dp_degree, dims.dp_rank()
    for step in range(2):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(0, args.vocab_size, (2, 17), generator=g)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        ref_loss = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten(), reduction="sum") / labels.numel()
        ref_loss.backward()
        rows = slice(dp_rank * 2 // dp, (dp_rank + 1) * 2 // dp)
        with loss_parallel() if lp else torch.enable_grad():
            logits = model(inputs[rows])
            assert isinstance(logits, DTensor) == lp, name
            loss = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten(), reduction="sum")
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            (loss * dp / labels.numel()).backward()  # as the trainer: FSDP averages over dp
        total = loss.detach().clone()
        if dims.get_mesh("dp_cp") is not None:
            torch.distributed.all_reduce(total, group=dims.get_mesh("dp_cp").get_group())
        assert abs(total.item() / labels.numel() - ref_loss.item()) <= 1e-5, (name, step, total, ref_loss)
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(grad, ref_params[n].grad, atol=1e-5, rtol=1e-4, msg=f"{name} grad {n}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(full.detach(), ref_params[n].detach(), atol=1e-5, rtol=0, msg=f"{name} param {n}")
    return f"CHECK {name} ok loss={ref_loss.item():.4f}"



def main() -> None:
    from titanlike.distributed.init import destroy_distributed, init_distributed

    rank, world, _ = init_distributed("cpu", timeout_s=120)
    torch.set_num_threads(1)
    for name, case in {**CASES, **(COMPILE_CASES if RUN_COMPILE else {})}.items():
        line = _plan_case(name, *case, rank=rank, world=world)
        if rank == 0:
            print(line, flush=True)
    torch.distributed.barrier()
    destroy_distributed()
    sys.stdout.flush()
    os._exit(0)  # skip the interpreter teardown (gloo's background thread occasionally aborts it on torch 2.13)


if __name__ == "__main__":
    main()
