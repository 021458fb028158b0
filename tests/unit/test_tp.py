"""Tensor parallel without processes: the Llama plan dict, divisibility errors, config rules, async-TP fallback.

The numerical parity runs in tests/multiproc/test_dist_tp.py; scripts/train.py under TP in
tests/multiproc/test_dist_train_script.py.
"""
from __future__ import annotations

import logging
import types

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

import models
from parallelize import PlanSections, get_plan
from parallelize.llama3 import llama_tp_plan
from parallelize.tp import ReplicateParallel, describe_plan, maybe_enable_async_tp
from models.llama3 import SPEC
from titanlike.config import ConfigError, JobConfig, config_from_dict, validate
from titanlike.distributed.parallel_dims import ParallelDims


def meta_llama(**kw) -> torch.nn.Module:
    spec = models.get_spec("llama3")
    args = spec.args_cls(**{"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128,
                            "multiple_of": 32, "max_seq_len": 16, **kw})
    with torch.device("meta"):
        return spec.model_cls(args)


def test_llama_plan_is_the_megatron_layout():
    plan = llama_tp_plan(sequence_parallel=True, loss_parallel=True)
    kinds = {
        "tok_embeddings": RowwiseParallel, "layers.*.attention_norm": SequenceParallel,
        "layers.*.attention": PrepareModuleInput, "layers.*.attention.wq": ColwiseParallel,
        "layers.*.attention.wk": ColwiseParallel, "layers.*.attention.wv": ColwiseParallel,
        "layers.*.attention.wo": RowwiseParallel, "layers.*.ffn_norm": SequenceParallel,
        "layers.*.feed_forward": PrepareModuleInput, "layers.*.feed_forward.w1": ColwiseParallel,
        "layers.*.feed_forward.w3": ColwiseParallel, "layers.*.feed_forward.w2": RowwiseParallel,
        "norm": SequenceParallel, "output": ColwiseParallel,
    }
    assert list(plan) == list(kinds)  # parents before children: the order parallelize_module applies them in
    assert all(isinstance(plan[k], kind) for k, kind in kinds.items()), plan
    assert plan["tok_embeddings"].output_layouts == (Shard(1),)
    assert plan["layers.*.attention.wo"].output_layouts == (Shard(1),)
    assert plan["layers.*.attention"].input_layouts == (Shard(1), None)  # the RoPE table is left alone
    # Column-wise q/k/v hand plain tensors to attention: SDPA never sees a DTensor.
    assert all(plan[f"layers.*.attention.{w}"].use_local_output for w in ("wq", "wk", "wv"))
    out = plan["output"]
    assert out.output_layouts == (Shard(-1),) and not out.use_local_output  # vocab-sharded DTensor logits

    plain = llama_tp_plan(sequence_parallel=False, loss_parallel=False)
    assert plain["output"].output_layouts == (Replicate(),) and plain["output"].use_local_output
    assert plain["layers.*.attention.wo"].output_layouts == (Replicate(),)
    assert isinstance(plain["norm"], ReplicateParallel) and isinstance(plain["layers.*.ffn_norm"], ReplicateParallel)
    assert "layers.*.attention.wq" in describe_plan(plain)


@pytest.mark.parametrize("kw,tp,message", [  # the spec's checks, as the TP plan runs them on a hand-built ParallelDims
    ({"n_heads": 4, "n_kv_heads": 1}, 2, r"n_kv_heads=1 which parallelism.tp=2 does not divide; use tp in \{1\}"),
    ({"dim": 48, "n_heads": 6, "n_kv_heads": 6}, 4, r"n_heads=6 which parallelism.tp=4 does not divide; use tp in "
                                                    r"\{1,2,3,6\}"),
    ({"multiple_of": 7}, 2, r"FFN hidden size 175"),
])
def test_divisibility_errors(kw, tp, message):
    dims = ParallelDims(tp=tp, world_size=tp)
    with pytest.raises(ValueError, match=message):
        get_plan("llama3", "default")(meta_llama(**kw), dims, PlanSections.of(JobConfig()))


def test_gqa_with_tp_equal_to_kv_heads_is_fine():
    assert SPEC.check(meta_llama(n_heads=8, n_kv_heads=2).args, ParallelDims(tp=2, world_size=2), "x") == []
    assert SPEC.check(meta_llama(n_heads=4, n_kv_heads=4).args, ParallelDims(tp=4, world_size=4), "x") == []


def test_fsdp_only_plan_refuses_tp():
    dims = ParallelDims(tp=2, world_size=2)
    with pytest.raises(ValueError, match="model.plan='fsdp_only' applies FSDP only, but parallelism.tp=2"):
        get_plan("llama3", "fsdp_only")(meta_llama(), dims, PlanSections.of(JobConfig()))


def test_config_rules():
    def cfg(**par):
        return config_from_dict({"parallelism": {"dp_shard": 1, **par}, "training": {"seq_len": 102}})

    with pytest.raises(ConfigError, match="seq_len=102 must be divisible by parallelism.tp=4 .*"
                                          "enable_sequence_parallel=false"):
        validate(cfg(tp=4), world_size=4)
    validate(cfg(tp=4, enable_sequence_parallel=False), world_size=4)  # without SP any length works
    with pytest.raises(ConfigError, match="n_kv_heads=4 which parallelism.tp=8 does not divide"):  # at load time
        validate(cfg(tp=8, enable_sequence_parallel=False), world_size=8)
    with pytest.raises(ConfigError, match="parallelism.enable_async_tp needs compile.enable=true"):
        validate(cfg(tp=4, enable_async_tp=True, enable_sequence_parallel=False), world_size=4)
    ok = config_from_dict({"parallelism": {"tp": 4, "dp_shard": 1, "enable_async_tp": True},
                           "compile": {"enable": True}})
    validate(ok, world_size=4)


def test_async_tp_falls_back_off_cuda():
    records = []
    handler = logging.Handler()
    handler.emit = records.append  # on the titanlike logger itself: setup_logging() turns propagation off
    log = logging.getLogger("titanlike")
    log.addHandler(handler)
    try:
        cpu_mesh = types.SimpleNamespace(device_type="cpu")
        assert maybe_enable_async_tp(cpu_mesh, enable=True, compile_enabled=True) is False
        assert maybe_enable_async_tp(cpu_mesh, enable=False, compile_enabled=True) is False
    finally:
        log.removeHandler(handler)
    text = " ".join(r.getMessage() for r in records)
    assert "needs CUDA" in text and "running synchronous TP" in text
    assert not torch._inductor.config._micro_pipeline_tp


def test_only_the_embeddings_view_warning_is_quieted():
    """FSDP2's "returned a view tensor" is quieted for embeddings under TP (their to_local() output is a view no model
    here modifies in place), and only for them."""
    import re
    import warnings

    from parallelize.tp import EMBEDDING_VIEW_WARNING, quiet_embedding_view_warning

    text = "FSDP2-wrapped module ({}) returned a view tensor. An in-place op on this view (e.g., `x += y`) will ..."
    assert re.match(EMBEDDING_VIEW_WARNING, text.format("FSDPEmbedding"))
    assert re.match(EMBEDDING_VIEW_WARNING, text.format("FSDPEmbedding, FSDPEmbedding"))  # GPT: tokens + positions
    assert not re.match(EMBEDDING_VIEW_WARNING, text.format("FSDPTransformerBlock"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_embedding_view_warning()
        warnings.warn(text.format("FSDPEmbedding"), UserWarning)
        warnings.warn(text.format("FSDPLinear"), UserWarning)
    assert [str(w.message) for w in seen] == [text.format("FSDPLinear")]
