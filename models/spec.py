"""The model contract: everything the rest of the repository may know about a model family, in one ModelSpec.

A family lives in models/<name>/ (model, args, flavors, counts, HF adapter, checks) plus parallelize/<name>.py (its
plans); models/__init__.py lists it in MODELS. The trainer, checkpoint tools and scripts read a model only through
this contract, so adding a family touches nothing under titanlike/ or scripts/.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from models.batch import Objective
from models.cache import GenerationCache
from models.common.kv_cache import KVCache


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter, shared ones once
    active: int  # those one token passes through (the total for dense models; routed experts count top-k of n)
    embedding: int  # the input embedding table (a lookup, no matmul FLOPs)


@dataclass(frozen=True)
class ModelShape:
    """What the planner's cost model reads of a model's shape (titanlike/planner/planner.py)."""
    dim: int  # the residual stream's width (what TP, PP and EP move per token)
    n_layers: int
    kv_dim: int  # keys plus values per token in one attention layer (what context parallel gathers)
    moe_topk: int = 0  # routed experts per token (0: dense)
    # Context parallel, by layer kind: attention layers all-gather K/V (kv_dim each; the backward reduce-scatters their
    # gradients); recurrent mixers (Mamba-2, Gated DeltaNet: parallelize/cp_recurrent.py) all-to-all the scan's inputs
    # to a head shard and its output back (the backward the same two in reverse); other layers (MLP, MoE) move nothing.
    kv_layers: int | None = None  # attention layers (None: all n_layers)
    cp_a2a_layers: int = 0  # recurrent layers, which exchange heads by all-to-all under CP
    cp_a2a_dim: int = 0  # per token and recurrent layer, the widths its two forward all-to-alls carry: the scan's
    #                      inputs plus its output, all heads (a TP rank holds 1/tp of them)
    # An attention layer's query and KV heads (0: no attention layers) and the widths of its queries plus its outputs
    # per token, all heads: parallelism.cp_method="alltoall" cuts the heads over the CP ranks (cp must divide a TP
    # rank's) and moves q, k, v and the output (qo_dim + kv_dim) where the other methods move K and V.
    heads: int = 0
    kv_heads: int = 0
    qo_dim: int = 0


@dataclass(frozen=True)
class PipelineCosts:
    """Training cost of each piece a pipeline stage can hold, in any one unit (FLOPs per token, say): the split
    balances their sums. `layers` maps each `layers` key to its cost; embedding/output are the modules before and
    after the blocks (the spec's input_modules / output_modules)."""
    layers: dict[str, float]
    embedding: float
    output: float


class HFAdapter(Protocol):
    """What a family's models/<name>/hf.py provides for Hugging Face import and export."""

    ARCHITECTURES: tuple[str, ...]  # config.json "architectures" entries it reads (the first is written)
    MODEL_TYPES: tuple[str, ...]  # config.json "model_type" values it reads when "architectures" is absent

    def to_hf(self, state_dict: dict, args: Any) -> dict: ...
    def from_hf(self, hf_state_dict: dict, args: Any) -> dict: ...
    def args_from_hf_config(self, config: dict) -> Any: ...
    def hf_config(self, args: Any, dtype: Any, max_position_embeddings: int | None = None) -> dict: ...


class MegatronAdapter(Protocol):
    """What a family's models/<name>/megatron.py provides for Megatron-LM checkpoint import and export. Its dicts are
    the canonical Megatron state dict of models/common/megatron_utils.py (whole tensors, global layer numbers);
    titanlike/checkpoint/megatron.py reads and writes the on-disk formats around them."""

    POSITION_EMBEDDING_TYPES: tuple[str, ...]  # Megatron --position-embedding-type values this family trains
    TP_SPLIT: dict[str, str]  # Megatron key or per-layer suffix -> "col" | "row" | "rep" | "glu" (how TP shards it)

    # Whether these Megatron args are this family's model (scripts/from_megatron.py and convert_megatron.py pick the
    # family by it). The position type alone cannot tell a hybrid (pretrain_mamba.py) model from a GPT one; an adapter
    # without it claims by position type (models/common/megatron_utils.claims).
    def claims(self, margs: dict) -> bool: ...

    def args_from_megatron(self, margs: dict) -> Any: ...  # ValueError naming the Megatron flag it cannot follow
    def notes(self, margs: dict) -> list[str]: ...  # what imports but computes slightly differently
    def from_megatron(self, msd: dict, args: Any, margs: dict | None = None) -> dict: ...
    def to_megatron(self, state_dict: dict, args: Any) -> dict: ...
    def megatron_args(self, args: Any) -> dict: ...  # Megatron-LM argument names -> values


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type  # model_cls(args) under torch.device("meta"); .init_weights(buffer_device) after sharding
    # A dataclass with (at least) vocab_size, max_seq_len and n_layers, which the trainer sets from the run
    # (repeat_kv_heads too, where it exists); checkpoints store dataclasses.asdict(args), rebuilt by args_cls(**d).
    args_cls: type
    flavors: dict[str, Any]  # flavor name -> args (read-only: derive copies with dataclasses.replace)
    plans: str  # module under parallelize/ whose PLANS dict maps plan names to fn(model, dims, sections) -> model
    param_counts: Callable[[Any], ParamCounts]  # args -> exact counts
    flops_per_token: Callable[[Any, int], int]  # (args, seq_len) -> training FLOPs per token (forward + backward)
    pp_costs: Callable[[Any, int], PipelineCosts]  # (args, seq_len) -> costs the pipeline split balances
    shape: Callable[[Any], ModelShape]  # args -> the widths the planner's cost model reads
    # (args, parallelism section, flavor name) -> problems, each naming the key and the fix; the parallelism section
    # is read for its degrees (tp, cp, ep, pp), so models/ needs no config import.
    check: Callable[[Any, Any, str], list[str]]
    # Top-level modules before the blocks (the first pipeline stage holds them; FSDP groups each on its own) and after
    # them (the last stage; one FSDP group; the last is the output projection, which the chunked loss replaces).
    # Every other parameter lives in `layers`.
    input_modules: tuple[str, ...]
    output_modules: tuple[str, ...]
    hf: HFAdapter | None = None
    megatron: MegatronAdapter | None = None
    # What it is trained to predict (models/batch.py): a name in models.batch.OBJECTIVES ("next_token", "masked_lm")
    # or the family's own factory args -> Objective; it turns each loader batch into the Batch the forward reads.
    objective: str | Callable[[Any], Objective] = "next_token"
    # ModelArgs fields that are run settings rather than architecture: ignored when matching args to a flavor.
    run_fields: tuple[str, ...] = field(default=("vocab_size", "max_seq_len"))
    # What generation keeps between forwards (models/cache.py): (model, rows, max_len) -> GenerationCache. The
    # default caches attention K/V per block (models/common/kv_cache.py); a family with recurrent or other state
    # declares its own.
    cache: Callable[[Any, int, int], GenerationCache] = KVCache.for_model
    # Output heads besides `output` that float8 keeps in high precision (float8/filter.py, while
    # float8.keep_model_heads): FQN patterns of Linears whose outputs feed a loss directly. `output`, the LM head or
    # tied decoder, is kept by float8.filter_fqns' default in every family.
    float8_keep: tuple[str, ...] = ()
    # The recurrent mixers' per-head sizes that model.mixer_kernel's fla kernels receive, by config key (args ->
    # {"model.args.<field>": size}; empty where the model has no such mixer): config validation refuses
    # mixer_kernel = "fla" for a size above models.common.fla_kernels.MAX_HEAD_DIM before any process group exists.
    mixer_sizes: Callable[[Any], dict[str, int]] | None = None

    def flavor_args(self, flavor: str, changes: dict | None = None) -> Any:
        """The flavor's args with `changes` (model.args: {field: value}) applied; ValueError naming the field."""
        if flavor not in self.flavors:
            raise ValueError(f"model.flavor={flavor!r} unknown for {self.name}; choose one of {sorted(self.flavors)}")
        base = self.flavors[flavor]
        if not changes:
            return base
        names = {f.name: f for f in dataclasses.fields(base)}
        for key, value in changes.items():
            if key not in names and key.startswith("mtp_"):  # the one family-independent option worth a pointer
                raise ValueError(f"model.args.{key} is not a field of {self.name}'s args: multi-token prediction "
                                 f"needs a decoder whose embedding and output head the MTP modules can share "
                                 f"(llama3, deepseek_v3; docs/mtp.md): use one of those or drop model.args.{key}")
            if key not in names:
                raise ValueError(f"model.args.{key} is not a field of {self.name}'s args; choose from {sorted(names)}")
            old = getattr(base, key)
            # the flavor's value tells the field's kind (None: any); an int is a fine float
            if old is not None and not (isinstance(value, type(old)) or (type(old) is float and type(value) is int)):
                raise ValueError(f"model.args.{key} = {value!r}: expected a {type(old).__name__} like the "
                                 f"flavor's {old!r}")
        try:
            return dataclasses.replace(base, **changes)
        except (ValueError, TypeError) as e:  # the args' own rules (dim divisible by n_heads, ...)
            raise ValueError(f"model.args {changes}: {e}") from None

    def find_flavor(self, args: Any) -> str | None:
        """The flavor with the same architecture as `args` (run fields aside), or None."""
        def arch(a: Any) -> dict:
            return {k: v for k, v in dataclasses.asdict(a).items() if k not in self.run_fields}

        return next((name for name, fa in self.flavors.items() if arch(fa) == arch(args)), None)
