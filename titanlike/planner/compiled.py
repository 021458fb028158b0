"""What a compiled block keeps for its backward, for the memory estimate.

The run compiles each transformer block (parallelize/compile.py); the trace cannot run compiled code under the
memory trackers, and eager autograd keeps more: every intermediate an op saves, where the compiled block's min-cut
partitioner saves fewer tensors and recomputes cheap elementwise ops in the backward. Under float8 the gap is
largest: the partitioner saves the float8 casts of the matmul inputs (1 byte per element) instead of the bf16 ones.

So before the traced step, each kind of block is compiled once on fake tensors through AOTAutograd with the
partitioner Inductor uses (`min_cut_rematerialization_partition`, compiler="inductor"; no code generation), and
the forward graph's saved outputs are summed: the bytes one block keeps alive from its forward to its backward,
the run's AC mode (the checkpoint is traced into the graph) and `memory_budget` included. During the trace each
such block runs as a full checkpoint (it keeps only its inputs) plus one allocation of exactly those bytes, freed
when its backward starts; the backward recomputes the block in eager mode, so the transient of one block's backward
is the eager one (a small overcount). Expert-parallel MoE blocks (which the run compiles child by child, the exchange
eager) are traced as they are.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger("titanlike")


class _Keep(torch.autograd.Function):
    """Identity whose forward allocates `nbytes` that live until its backward: the compiled block's saved tensors."""

    @staticmethod
    def forward(ctx, out, nbytes: int):
        ctx.kept = torch.empty(nbytes, dtype=torch.uint8, device=out.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        ctx.kept = None  # the compiled backward starts freeing them at once; the recompute follows
        return grad, None


def saved_bytes(fn, args: tuple, kwargs: dict) -> int:
    """Bytes `fn(*args, **kwargs)` keeps for backward when compiled by Inductor's partitioner: the distinct storages
    of the forward graph's saved outputs that are not graph inputs (parameters, the block's input)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.multiprocessing.reductions import StorageWeakRef

    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            from functorch.compile import make_boxed_func

            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                           partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    out = compiled(*args, **kwargs)
    (out.to_local() if hasattr(out, "to_local") else out).sum().backward()
    fw, bw = graphs["fw"], graphs["bw"]
    n_saved = sum(1 for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents"))
    outputs = list(fw.graph.output_node().args[0])
    saved = outputs[len(outputs) - n_saved:] if n_saved else []

    def storage(n):
        v = n.meta.get("val") if hasattr(n, "meta") else None
        return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None

    seen = {storage(n) for n in fw.graph.nodes if n.op == "placeholder"}
    total = 0
    for n in saved:
        key = storage(n)
        if key is None or key in seen:
            continue
        seen.add(key)
        total += _as_int(n.meta["val"].untyped_storage().nbytes())
    return total


def _as_int(n) -> int:
    """A size that may be symbolic (storages inside a traced checkpoint are): its value for the traced shapes."""
    if isinstance(n, torch.SymInt):
        node = n.node
        return int(node.hint if node.hint is not None else node.shape_env.size_hint(node.expr))
    return int(n)


def _block_key(block) -> tuple:
    """Blocks with equal keys compile to the same graph: one measurement serves them all."""
    return (type(block).__name__, tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()))


def _measure(block, args, kwargs, context) -> int:
    from torch.distributed.fsdp import FSDPModule

    fsdp = isinstance(block, FSDPModule)
    if fsdp:
        block.unshard()  # (fake all-gather) the compiled region runs on the unsharded parameters
    try:
        x = args[0].detach().requires_grad_(True)
        with context():  # the run's autocast: what the compiled block saves is in the dtype it computes in
            return saved_bytes(block.forward, (x, *args[1:]), kwargs)
    finally:
        if fsdp:
            block.reshard()
        for p in block.parameters():
            p.grad = None


def block_inputs(parts, run_forward) -> list:
    """[(block, (args, kwargs))] for every block of `parts`, from one forward without autograd (run_forward())."""
    got, handles = [], []

    def hook(module, args, kwargs):
        if all(b is not module for b, _ in got):
            got.append((module, (args, kwargs)))

    for part in parts:
        for block in part.layers.values():
            if block is not None:
                handles.append(block.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for h in handles:
            h.remove()
    return got


@contextlib.contextmanager
def emulate_compiled_blocks(blocks_with_inputs, notes: list, context=contextlib.nullcontext):
    """While entered, each compiled block keeps exactly what its compiled version keeps (module docstring).
    blocks_with_inputs: [(block, (args, kwargs))] of the blocks the run compiles; context(): the context the run's
    forward is under (autocast)."""
    from parallelize.ac import forward_without_checkpoint, fully_checkpointed
    from models.common.moe import GroupedExperts
    from parallelize.ep import ep_experts

    cache, patched, moe_blocks = {}, [], False
    for block, (args, kwargs) in blocks_with_inputs:
        if ep_experts(block):
            continue  # compiled per child around an eager exchange (parallelize/compile.py): traced eager
        if fully_checkpointed(block):
            continue  # keeps only its inputs, compiled or eager: the trace has it right already
        if any(isinstance(m, GroupedExperts) for m in block.modules()):
            # the trace's expert loop reads balanced row counts on the host (titanlike/planner/moe.py), which a
            # compiled graph turns into unbacked sizes: traced eager (within 10% on the MoE shapes measured)
            moe_blocks = True
            continue
        key = _block_key(block)
        if key not in cache:
            try:
                cache[key] = _measure(block, args, kwargs, context)
            except Exception as e:  # a block the partitioner trace cannot handle: traced as eager
                logger.debug("compiled-block measurement failed", exc_info=True)
                cache[key] = None
                notes.append(f"a {type(block).__name__} could not be traced compiled ({type(e).__name__}): its "
                             f"eager activations are counted (an overestimate)")
        if cache[key] is None:
            continue
        # the block's own forward, not its AC wrapper's: a selective checkpoint inside ours would keep its saved
        # outputs as well (they are in the measured bytes already)
        block.forward = functools.partial(_kept_forward, forward_without_checkpoint(block), cache[key])
        patched.append(block)
    if moe_blocks:
        notes.append("MoE blocks traced eager (their compiled saved tensors are not emulated)")
    if patched:
        notes.append("compiled blocks: each keeps the bytes Inductor's partitioner saves for its backward "
                     f"({', '.join(f'{v / 2**20:.0f} MiB' for v in dict.fromkeys(x for x in cache.values() if x))} "
                     "per block on this rank)")
    try:
        yield
    finally:
        for block in patched:
            del block.forward  # back to the class's forward


def _kept_forward(orig, nbytes: int, *args, **kwargs):
    out = checkpoint(orig, *args, use_reentrant=False, **kwargs)
    return _Keep.apply(out, nbytes)
