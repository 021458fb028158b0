"""The Qwen3 parallelization plans (dense and MoE); parallelize/mixtral.py builds its plans with the same functions.
Order, kept visible: TP -> EP -> AC -> compile -> FSDP (as parallelize/llama3.py, with the expert-parallel hook after
TP: both change parameter placements, which AC, compile and FSDP then see). Compile: every block, fullgraph; the
expert-parallel MoE blocks child by child, their all-to-all exchange eager (parallelize/compile.py says why).

MoE blocks under TP: the router and the routed experts are not TP-sharded. The MoE gathers the sequence (when
sequence parallel), every TP rank computes the whole MoE on the same tokens, and hands back its own sequence shard:
correct, but the expert FLOPs repeat tp times, so MoE flavors are meant for FSDP + EP (parallelize/ep.py),
not TP. Their parameters are replicated DTensors on the TP mesh, so the optimizer and FSDP see one kind of parameter
and their gradients (identical on every TP rank) need no reduction.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
)

from models.qwen3 import SPEC
from parallelize.ac import apply_ac
from parallelize.compile import apply_compile
from parallelize.cp import maybe_cp
from parallelize.ep import maybe_ep
from parallelize.fsdp import maybe_fsdp
from parallelize.tp import (
    ReplicateParallel, SyncOutputColwiseParallel, SyncOutputRowwiseParallel, apply_tp, maybe_enable_async_tp,
)


class ReplicateParams(ParallelStyle):
    """Parameters become Replicate DTensors on the TP mesh; inputs and outputs stay as they are. For the routed
    experts, which read their weights through `to_local()` (models/common/moe.py) and take the token counts beside
    the tokens: wrapping those inputs as DTensors (ReplicateParallel) would mix plain and DTensor operands."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh)


class ReplicateRouter(ParallelStyle):
    """The router's parameters become Replicate DTensors; its tensor inputs are wrapped as Replicate DTensors (they
    are the same on every TP rank: the MoE gathered the sequence) and its outputs, a tuple, handed back as local
    tensors. The router reads `gate.weight` directly (models/common/router.py), so a hook on the gate Linear alone
    (ReplicateParallel) would never run; ReplicateParallel on the router would not unwrap a tuple."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=ReplicateParallel._input_fn,
                                 output_fn=self._output_fn)

    @staticmethod
    def _output_fn(module, outputs, device_mesh):
        items = outputs if isinstance(outputs, tuple) else (outputs,)
        local = tuple(x.to_local() if isinstance(x, DTensor) else x for x in items)
        return local if isinstance(outputs, tuple) else local[0]


def _blocks(model: nn.Module) -> dict[str, nn.Module]:
    return {k: b for k, b in model.layers.items() if b is not None}


def _ffn_keys(model: nn.Module, attr: str) -> list[str]:
    """Plan keys for the blocks whose FFN is `attr` ("feed_forward" or "moe"): "layers.*" when every block of this
    model (or stage) has it, else one key per block (a "*" key warns on each block it does not resolve in)."""
    blocks = _blocks(model)
    keys = [k for k, b in blocks.items() if hasattr(b, attr)]
    if keys and len(keys) == len(blocks):
        return ["layers.*"]
    return [f"layers.{k}" for k in keys]


def decoder_tp_plan(model: nn.Module, *, sequence_parallel: bool = True, loss_parallel: bool = True,
                    qk_norm: bool = True, ep_enabled: bool = False) -> dict[str, ParallelStyle]:
    """Module path -> DTensor style for a Llama-named decoder whose blocks hold `feed_forward` or `moe`
    (parallelize/tp.py describes the layouts). qk_norm: attention.q_norm / k_norm act per head on TP-sharded heads.
    ep_enabled: the experts are left to parallelize/ep.py."""
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": SyncOutputRowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=seq),
        "layers.*.ffn_norm": SequenceParallel(),
    }
    for key in _ffn_keys(model, "feed_forward"):
        plan[f"{key}.feed_forward"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        plan[f"{key}.feed_forward.w1"] = ColwiseParallel()
        plan[f"{key}.feed_forward.w3"] = ColwiseParallel()
        plan[f"{key}.feed_forward.w2"] = RowwiseParallel(output_layouts=seq)
    for key in _ffn_keys(model, "moe"):
        # The whole sequence in (one all-gather), the same MoE on every TP rank, this rank's shard out (a slice).
        plan[f"{key}.moe"] = PrepareModuleInputOutput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(seq,), use_local_output=True)
        plan[f"{key}.moe.router"] = ReplicateRouter()
        if not ep_enabled:
            plan[f"{key}.moe.experts"] = ReplicateParams()
    plan["norm"] = SequenceParallel()
    # Loss parallel keeps the logits vocabulary-sharded (a DTensor, so loss_parallel() sees the sharding).
    plan["output"] = SyncOutputColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else
                                               Replicate(), use_local_output=not loss_parallel)
    if not sequence_parallel:  # the norms then see the whole sequence on every rank: replicated parameters
        plan = {k: ReplicateParallel() if isinstance(v, SequenceParallel) else v for k, v in plan.items()}
    if qk_norm:
        # Added after the swap above: these norms see TP-sharded heads (dim 2 of [B, S, H, head_dim]) with or
        # without sequence parallel; sharding on the head dim makes their weight gradients sum over the TP ranks.
        plan["layers.*.attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["layers.*.attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def make_plans(spec, qk_norm: bool) -> dict:
    """PLANS ("default", "fsdp_only") for a decoder family with these module names (`spec`: its ModelSpec)."""

    def refuse_unimplemented(dims, allow: tuple[str, ...]) -> None:
        # Config validation refuses these first; checking here keeps a hand-built ParallelDims honest.
        for name, degree in (("tp", dims.tp), ("pp", dims.pp), ("cp", dims.cp), ("ep", dims.ep)):
            if degree > 1 and name not in allow:
                raise ValueError(f"parallelism.{name}={degree}: this {spec.name} plan does not implement "
                                 f"{name.upper()}; set parallelism.{name}=1")

    def check(model: nn.Module, dims, cfg) -> None:
        problems = spec.check(model.args, dims, cfg.model.flavor)  # config validation ran it too
        if problems:
            raise ValueError(problems[0])

    def maybe_tp(model: nn.Module, dims, cfg) -> None:
        if not dims.tp_enabled:
            return
        par = cfg.parallelism
        tp_mesh = dims.get_mesh("tp")
        plan = decoder_tp_plan(model, sequence_parallel=par.enable_sequence_parallel,
                               loss_parallel=par.enable_loss_parallel, qk_norm=qk_norm, ep_enabled=dims.ep > 1)
        apply_tp(model, tp_mesh, plan)
        maybe_enable_async_tp(tp_mesh, par.enable_async_tp,
                              compile_enabled=cfg.compile.enable and "model" in cfg.compile.components)

    def parallelize_default(model: nn.Module, dims, cfg) -> nn.Module:
        """TP -> EP -> CP -> AC -> per-block compile -> FSDP2/HSDP. `cfg` is the JobConfig; returns the model."""
        # pp: parallelize/pp.py splits the model first and calls the plan on each stage (modules it lacks are None).
        refuse_unimplemented(dims, allow=("tp", "pp", "ep", "cp"))
        check(model, dims, cfg)
        maybe_tp(model, dims, cfg)  # first: it changes the parameter placements that AC/compile/FSDP then see
        maybe_ep(model, dims, cfg)
        maybe_cp(model, dims)  # before AC and compile, which trace the attention kernel it installs
        apply_ac(model, cfg.activation_checkpoint)
        apply_compile(model, cfg.compile)
        maybe_fsdp(model, dims, cfg, spec.input_modules, spec.output_modules)
        return model

    def parallelize_fsdp_only(model: nn.Module, dims, cfg) -> nn.Module:
        """FSDP2/HSDP only (EP and CP too where set); ignores the AC and compile sections (a baseline for debugging)."""
        if dims.tp_enabled:
            raise ValueError(f"model.plan='fsdp_only' applies FSDP only, but parallelism.tp={dims.tp}; use "
                             f"model.plan='default' (TP -> EP -> AC -> compile -> FSDP) or set parallelism.tp=1")
        refuse_unimplemented(dims, allow=("pp", "ep", "cp"))
        check(model, dims, cfg)
        maybe_ep(model, dims, cfg)
        maybe_cp(model, dims)
        maybe_fsdp(model, dims, cfg, spec.input_modules, spec.output_modules)
        return model

    parallelize_default.__name__ = f"parallelize_{spec.name}"
    parallelize_fsdp_only.__name__ = f"parallelize_{spec.name}_fsdp_only"
    return {"default": parallelize_default, "fsdp_only": parallelize_fsdp_only}


# Plan name (model.plan) -> plan; models/qwen3's ModelSpec points here.
PLANS = make_plans(SPEC, qk_norm=True)
