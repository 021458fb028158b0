"""Layout-independent weight initialisation: every layout starts from the weights of the one-process run.

`nn.init.trunc_normal_(w, ...)` on a sharded DTensor draws from DTensor's RNG, whose stream depends on the mesh and
the placements (and on a CPU mesh it warns on every call); under pipeline parallelism each stage draws from its
own position in the global stream. So FSDP 2, TP 2, PP 2 and one process would start from four different models.

`seeded_init(module, seed)` is a context manager around `module.init_weights(...)` (the models stay plain: nothing
distributed in `models/`). While it is active, a random init of one of the module's parameters is drawn from a
`torch.Generator` seeded by (seed, the parameter's FQN, how many draws this parameter had, the block) — not from the
global RNG — on a plain tensor of the parameter's GLOBAL shape, and this rank keeps the elements its shard holds.
The one-process run goes through the same code, so it is the reference by construction; FQNs are the whole model's
under PP too (`parallelize/pp.py`), so a stage draws the same values as the whole model; a stage's own copy of a
tied parameter (the model's `tied_parameters`, e.g. a last stage's output.weight) draws as its source.

Two routes, because `nn.init.trunc_normal_` does not dispatch `__torch_function__` and, in torch 2.13, draws by
rejection on temporaries (`empty_like(tensor).normal_()` in a loop ended by `.any()`), so no mode sees it whole:
- `torch.nn.init`'s random functions (`RANDOM_INITS`) are replaced, for the duration, by wrappers: on a parameter of
  the module they run the original function on plain tensors with the seeded generator; on anything else they call
  the original (so another thread's `nn.init` call is unaffected).
- A TorchDispatchMode routes a random in-place aten op (`param.normal_()`, `param.uniform_()`, ...) issued directly on
  a parameter of the module the same way, and warns once per op about any other random op on a DTensor (its
  values would depend on the layout: e.g. the rejection redraws of a `trunc_normal_` imported by name before the
  patch, `torch.randn_like(param)`, or a random op on a slice of a parameter). Random tensors made from no DTensor
  and copied into a parameter go unnoticed: they are the caller's business.
Non-random init (`zeros_`, `ones_`, `constant_`, `copy_`) is untouched: it gives the same values on any layout.

Which elements a rank holds is asked of DTensor itself: for each tensor dimension, `distribute_tensor` of
`arange(size)` with the parameter's placements on that dimension (`_StridedShard` of FSDP over TP included) and
`src_data_rank=None` (local slicing, no communication) gives the global indices of this rank's rows/columns.

Memory: shape-independent functions (`ELEMENTWISE`: trunc_normal_, normal_, uniform_, and random aten ops) draw in
blocks along dim 0 of about `BLOCK_NUMEL` elements (the block's rows depend on the global shape only, so the values
do not depend on the layout) and a rank draws only the blocks holding some of its rows: the temporary is one block,
and FSDP/EP ranks draw only their share; a rank holding the whole parameter (one process, a replicated parameter)
draws into it in place, with no temporary. Functions that read the shape (xavier/kaiming fans, orthogonal's QR,
sparse_'s columns) draw the whole parameter at once: a temporary of the full parameter's size.

The values depend on the torch version and the device type (CPU and CUDA generators differ), not on the layout.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# nn.init functions drawn per element with no regard to the shape: drawn in dim-0 blocks.
ELEMENTWISE = ("trunc_normal_", "normal_", "uniform_")
# nn.init functions that read the shape (fans, QR, columns): drawn whole.
SHAPED = ("xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
RANDOM_INITS = ELEMENTWISE + SHAPED
BLOCK_NUMEL = 1 << 24  # elements per dim-0 block (64 MiB in fp32); part of the values' definition: changing it
# changes every initial weight larger than one block.

# Wrapper prefixes that are not part of a parameter's name (the plans keep FQNs clean; this is a safety net).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_fqn(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def draw_seed(seed: int, fqn: str, draw: int, block: int) -> int:
    """A 63-bit generator seed from the run's seed and where the values go (hashlib: Python's hash() is salted)."""
    digest = hashlib.blake2b(f"{seed}/{fqn}/{draw}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _on_dim0(p, dim: int, ndim: int):
    """The placement `p` as it acts on tensor dimension `dim`, moved to dim 0 of a 1-D tensor."""
    if isinstance(p, _StridedShard):  # before Shard: a subclass of it in torch 2.11, not in 2.13
        return _StridedShard(0, split_factor=p.split_factor) if p.dim % ndim == dim else Replicate()
    if isinstance(p, Shard):
        return Shard(0) if p.dim % ndim == dim else Replicate()
    if isinstance(p, Replicate):
        return Replicate()
    raise ValueError(f"seeded_init: a parameter with placement {p} (only Shard, _StridedShard, Replicate)")


class _Router:
    """Fills the module's parameters from seeded generators; see the module docstring."""

    def __init__(self, module: nn.Module, seed: int, block_numel: int):
        self.seed = seed
        self.block_numel = block_numel
        self.params: dict[int, tuple[torch.Tensor, str]] = {}  # id -> (param, FQN); holds the param: ids stay
        for name, p in module.named_parameters():
            self.params[id(p)] = (p, clean_fqn(name))
        # A model's `tied_parameters` (source FQN, copy FQN): where a pipeline stage holds the copy without its
        # source, the copy draws the source's values (parallelize/tied.py keeps the two equal after that).
        names = {fqn for _, fqn in self.params.values()}
        alias = {dst: src for src, dst in getattr(module, "tied_parameters", ()) if src not in names}
        for key, (p, fqn) in self.params.items():
            self.params[key] = (p, alias.get(fqn, fqn))
        self.draws: Counter[str] = Counter()
        self._indices: dict[tuple, torch.Tensor] = {}

    def fqn(self, t) -> str | None:
        entry = self.params.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else None

    def _local_indices(self, param: torch.Tensor) -> list[torch.Tensor | None]:
        """Per dimension, the global indices this rank holds (CPU int64), or None for all of them."""
        if not isinstance(param, DTensor):
            return [None] * param.ndim
        mesh, out = param.device_mesh, []
        for dim, size in enumerate(param.shape):
            placements = tuple(_on_dim0(p, dim, param.ndim) for p in param.placements)
            if all(isinstance(p, Replicate) for p in placements):
                out.append(None)
                continue
            key = (mesh, placements, size)
            if key not in self._indices:
                index = distribute_tensor(torch.arange(size), mesh, placements, src_data_rank=None)
                self._indices[key] = index.to_local().cpu()
            out.append(self._indices[key])
        return out

    def fill(self, param: torch.Tensor, draw: Callable[[torch.Tensor, torch.Generator], object],
             elementwise: bool) -> None:
        """draw(plain_tensor, generator) fills a plain tensor (a dim-0 block of the global shape if `elementwise`,
        else the whole) in place; this rank's elements of the result go into `param`."""
        fqn = self.fqn(param)
        n = self.draws[fqn]
        self.draws[fqn] += 1
        shape = tuple(param.shape)
        local = param.to_local() if isinstance(param, DTensor) else param
        index = self._local_indices(param)
        assert tuple(local.shape) == tuple(len(i) if i is not None else s for i, s in zip(index, shape)), (
            fqn, tuple(local.shape), shape, getattr(param, "placements", None))
        if local.numel() == 0:
            return
        if not shape:  # a scalar parameter
            block = torch.empty((), dtype=param.dtype, device=local.device)
            draw(block, self._generator(fqn, n, 0, local.device))
            local.copy_(block)
            return
        rows = shape[0]
        whole = all(i is None for i in index)
        if elementwise:
            per_block = max(1, self.block_numel // max(1, math.prod(shape[1:])))
        else:
            per_block = max(1, rows)
        for b, r0 in enumerate(range(0, rows, per_block)):
            r1 = min(rows, r0 + per_block)
            if index[0] is None:
                pos = None
            else:
                hit = ((index[0] >= r0) & (index[0] < r1)).nonzero().squeeze(1)
                if hit.numel() == 0:
                    continue  # none of this block's rows are here: not drawn
                pos, src = hit.to(local.device), (index[0][hit] - r0).to(local.device)
            g = self._generator(fqn, n, b, local.device)
            if whole and local.is_contiguous():  # this rank holds the whole block: drawn in place, no temporary
                draw(local[r0:r1], g)
                continue
            block = torch.empty((r1 - r0, *shape[1:]), dtype=param.dtype, device=local.device)
            draw(block, g)
            if pos is not None:
                block = block.index_select(0, src)
            for dim in range(1, len(shape)):
                if index[dim] is not None:
                    block = block.index_select(dim, index[dim].to(local.device))
            if pos is None:
                local[r0:r1].copy_(block)
            else:
                local.index_copy_(0, pos, block)

    def _generator(self, fqn: str, draw: int, block: int, device: torch.device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(draw_seed(self.seed, fqn, draw, block))


@functools.lru_cache(maxsize=None)
def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)


def _with_generator(fn: Callable, args: tuple, kwargs: dict) -> Callable[[torch.Tensor, torch.Generator], object]:
    """fn(tensor, *args, **kwargs) on another tensor with the given generator (wherever the caller put theirs)."""
    bound = _signature(fn).bind(None, *args, **kwargs)
    first = next(iter(bound.arguments))

    def draw(t: torch.Tensor, g: torch.Generator):
        bound.arguments[first] = t
        bound.arguments["generator"] = g
        return fn(*bound.args, **bound.kwargs)

    return draw


@contextlib.contextmanager
def _patched_nn_init(router: _Router) -> Iterator[None]:
    originals = {name: getattr(nn.init, name) for name in RANDOM_INITS if hasattr(nn.init, name)}

    def wrap(name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(tensor, *args, **kwargs):
            if router.fqn(tensor) is None:
                return original(tensor, *args, **kwargs)
            with _disable_current_modes():  # the draws are on plain tensors: no need for _RandomOpRouter's eyes
                router.fill(tensor, _with_generator(original, args, kwargs), elementwise=name in ELEMENTWISE)
            return tensor

        return wrapper

    for name, original in originals.items():
        setattr(nn.init, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


def _routable(func) -> bool:
    """An aten op that writes random values into its first argument and takes a generator (uniform_, normal_, ...)."""
    schema = func._schema
    first = schema.arguments[0] if schema.arguments else None
    return (first is not None and first.alias_info is not None and first.alias_info.is_write
            and any(a.name == "generator" for a in schema.arguments))


class _RandomOpRouter(TorchDispatchMode):
    """Routes random in-place aten ops issued directly on a parameter; warns about random ops on other DTensors."""

    def __init__(self, router: _Router):
        super().__init__()
        self.router = router
        self.warned: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        target = args[0] if args else None
        others = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)]
        if self.router.fqn(target) is not None and not others and _routable(func):
            self.router.fill(target, lambda t, g: func(t, *args[1:], **{**kwargs, "generator": g}),
                             elementwise=True)
            return target
        if any(isinstance(a, DTensor) for a in (*args, *kwargs.values())) and str(func) not in self.warned:
            self.warned.add(str(func))
            warnings.warn(f"seeded_init: {func} on a DTensor that is not a whole parameter of the module: its values "
                          f"depend on the layout (route the init through torch.nn.init on the parameter)",
                          stacklevel=2)
        return func(*args, **kwargs)


@contextlib.contextmanager
def seeded_init(module: nn.Module, seed: int, block_numel: int | None = None) -> Iterator[None]:
    """Around `module.init_weights(...)` (under torch.no_grad()): the module's parameters get the values of the
    one-process run with the same `seed`, whatever their sharding. See the module docstring."""
    router = _Router(module, seed, block_numel or BLOCK_NUMEL)
    with _patched_nn_init(router), _RandomOpRouter(router):
        yield
