"""Megatron-LM checkpoints <-> titanlike (scripts/convert_megatron.py), against megatron-core itself on CPU.

The Megatron side is real megatron-core (0.16.1 tested; `pip install --no-deps megatron-core psutil`): this file, run
as a script in subprocesses, builds tiny Megatron-Core language models with the local (Transformer-Engine-free) layer
spec on gloo, computes their logits and writes their checkpoints with Megatron's own code:
  - torch_dist with `dist_checkpointing.save(model.sharded_state_dict())` (1 process);
  - legacy `mp_rank_XX[_YYY]/model_optim_rng.pt` with `model.state_dict_for_save_checkpoint()`, as Megatron-LM's
    --ckpt-format torch writes it: TP1, and TP2 and PP2 by 2 gloo processes with parallel_state at TP=2 (then PP=2)
    that load the torch_dist checkpoint with `dist_checkpointing.load` (Megatron shards it) and save their shards.
The `args` namespace is written by hand with Megatron-LM's argument names (Megatron-LM's arguments.py is not part of
megatron-core). Four CPU shims, in the worker processes only, let megatron-core 0.16.1 run without CUDA:
torch.cuda.current_device -> "cpu" (RoPE moves its frequencies to "the GPU"), torch.cuda.synchronize -> no-op (the
checkpoint writer), Tensor.cuda -> itself (a tied output layer on the last pipeline stage), and the model-parallel RNG
tracker's fork -> a null context (dropout is 0; it only wraps dropout).
An explicit causal mask is passed to the forward (the default one is built on "cuda").

Families: titanlike gpt tied and untied (learned positions, LayerNorm, tanh GELU: Megatron-LM's default fused
bias-GELU is the tanh approximation) and llama3 (rope, RMSNorm, SwiGLU, 4 heads in 2 query groups, no biases, untied).
Logits are compared in fp32 with atol 1e-4 (they agree to ~1e-6).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch

VOCAB, SEQ, ITER = 128, 16, 7
CONFIGS = {
    "gpt_tied": dict(pos="learned_absolute", norm="LayerNorm", glu=False, bias=True, tied=True, groups=4, ffn=256),
    "gpt_untied": dict(pos="learned_absolute", norm="LayerNorm", glu=False, bias=True, tied=False, groups=4, ffn=256),
    "llama": dict(pos="rope", norm="RMSNorm", glu=True, bias=False, tied=False, groups=2, ffn=96),
}
RESHARDED = ("llama", "gpt_tied")  # the ones also written as legacy TP2 and PP2
TOKENS = torch.arange(2 * SEQ).reshape(2, SEQ).mul(37).remainder(VOCAB)
ATOL = 1e-4


# ------------------------------------------------------------------------------ Megatron side (worker processes)
def _cpu_shims() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # tied embeddings under PP move the output copy "to the GPU"


def _init(rank: int, world: int, tp: int, pp: int, store: str) -> None:
    """`store`: a file the ranks of one launch meet at (no TCP port, so tests running in parallel never collide)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def _megatron_model(name: str, pre: bool = True, post: bool = True):
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = CONFIGS[name]
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=c["groups"], ffn_hidden_size=c["ffn"],
        normalization=c["norm"], gated_linear_unit=c["glu"], activation_func=F.silu if c["glu"] else F.gelu,
        bias_activation_fusion=not c["glu"], add_bias_linear=c["bias"], use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        tensor_model_parallel_size=_ps().get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=_ps().get_pipeline_model_parallel_world_size(), pipeline_dtype=torch.float32)
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization=c["norm"]), vocab_size=VOCAB,
                    max_sequence_length=32, position_embedding_type=c["pos"], pre_process=pre, post_process=post,
                    share_embeddings_and_output_weights=c["tied"]).eval()


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def _margs(name: str, tp: int = 1, pp: int = 1) -> argparse.Namespace:
    c = CONFIGS[name]
    return argparse.Namespace(
        num_layers=2, hidden_size=64, ffn_hidden_size=c["ffn"], num_attention_heads=4, kv_channels=16,
        group_query_attention=c["groups"] != 4, num_query_groups=c["groups"], seq_length=32, max_position_embeddings=32,
        padded_vocab_size=VOCAB, make_vocab_size_divisible_by=128, position_embedding_type=c["pos"],
        normalization=c["norm"], swiglu=c["glu"], add_bias_linear=c["bias"], bias_gelu_fusion=True,
        untie_embeddings_and_output_weights=not c["tied"], norm_epsilon=1e-5, rotary_base=10000,
        rotary_percent=1.0, hidden_dropout=0.0, attention_dropout=0.0, num_experts=None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, ckpt_format="torch")


def megatron_logits(model) -> torch.Tensor:
    mask = torch.triu(torch.ones(SEQ, SEQ), 1).bool()[None, None]  # True = masked (Megatron's convention)
    with torch.no_grad():
        return model(TOKENS, torch.arange(SEQ).expand(2, SEQ), attention_mask=mask).float()


def _save_legacy(model, root: str, name: str, tp: int, pp: int) -> None:
    t, p = _ps().get_tensor_model_parallel_rank(), _ps().get_pipeline_model_parallel_rank()
    folder = os.path.join(root, f"iter_{ITER:07d}", f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
    os.makedirs(folder, exist_ok=True)
    torch.save({"model": model.state_dict_for_save_checkpoint(), "args": _margs(name, tp, pp), "iteration": ITER,
                "checkpoint_version": 3.0}, os.path.join(folder, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITER))


def worker_build(out: str) -> None:
    """One process: each config's model, random weights (norms and biases too), its logits, torch_dist + legacy TP1."""
    from megatron.core import dist_checkpointing

    _cpu_shims()
    _init(0, 1, 1, 1, os.path.join(out, ".store_build"))
    for i, name in enumerate(CONFIGS):
        torch.manual_seed(i)
        model = _megatron_model(name)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "layernorm" in pname or "norm_weight" in pname
                        else 0.05 * torch.randn_like(p))
        torch.save(megatron_logits(model), os.path.join(out, f"{name}.logits.pt"))
        td = os.path.join(out, name, "td")
        os.makedirs(os.path.join(td, f"iter_{ITER:07d}"))
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": _margs(name), "iteration": ITER,
                                 "checkpoint_version": 3.0}, os.path.join(td, f"iter_{ITER:07d}"))
        with open(os.path.join(td, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITER))
        _save_legacy(model, os.path.join(out, name, "tp1"), name, 1, 1)


def _reshard_rank(rank: int, out: str, store: str) -> None:
    from megatron.core import dist_checkpointing

    _cpu_shims()
    for tp, pp, tag in ((2, 1, "tp2"), (1, 2, "pp2")):
        _init(rank, 2, tp, pp, store)
        for name in RESHARDED:
            model = _megatron_model(name, pre=_ps().is_pipeline_first_stage(), post=_ps().is_pipeline_last_stage())
            dist_checkpointing.load(model.sharded_state_dict(), os.path.join(out, name, "td", f"iter_{ITER:07d}"))
            _save_legacy(model, os.path.join(out, name, tag), name, tp, pp)


def worker_reshard(out: str) -> None:
    """Two processes: legacy TP2 and PP2 shards, as Megatron shards the torch_dist checkpoint."""
    torch.multiprocessing.spawn(_reshard_rank, args=(out, os.path.join(out, ".store_reshard")), nprocs=2)


def worker_load(out: str, pairs: str) -> None:
    """One process: load each exported torch_dist folder (name=path,...) into a fresh model; save its logits."""
    from megatron.core import dist_checkpointing

    _cpu_shims()
    _init(0, 1, 1, 1, os.path.join(out, f".store_load_{os.getpid()}"))
    for pair in pairs.split(","):
        name, path = pair.split("=")
        torch.manual_seed(123)
        model = _megatron_model(name)
        sd = model.sharded_state_dict()
        loaded = dist_checkpointing.load(sd, path)
        # common.pt's entries come back beside the weights, as Megatron-LM's load_checkpoint reads them
        assert loaded.pop("iteration") == 0 and loaded.pop("checkpoint_version") == 3.0
        assert loaded.pop("args").num_layers == 2
        model.load_state_dict(loaded, strict=True)
        torch.save(megatron_logits(model), os.path.join(out, f"{name}.export_logits.pt"))


# ------------------------------------------------------------------------------ titanlike side (pytest)
def _run_worker(*args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, f"megatron worker {args[0]} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


@pytest.fixture(scope="module")
def mcore(tmp_path_factory):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install --no-deps "
                                                "megatron-core psutil)")
    pytest.importorskip("psutil", reason="megatron-core's checkpoint writer needs psutil")
    out = str(tmp_path_factory.mktemp("mcore"))
    _run_worker("build_and_reshard", out)  # one interpreter for both (megatron-core's import costs ~4 s)
    return out


def convert(argv: list[str]) -> int:
    """scripts/convert_megatron.py's main() (scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_megatron", os.path.join(
        os.path.dirname(__file__), "..", "..", "scripts", "convert_megatron.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


def titanlike_logits(ckpt: str, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    from titanlike.checkpoint import layout
    from titanlike.checkpoint.states import full_model_state, model_from_meta

    path = layout.choose_step(ckpt, -1).path
    model, _ = model_from_meta(path)
    model.to_empty(device="cpu")
    model.init_weights()
    model.load_state_dict(full_model_state(path))
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    with torch.no_grad():
        return model.eval()(tokens).float()


@pytest.mark.parametrize("name,layout_", [(n, "td") for n in CONFIGS] + [(n, "tp1") for n in CONFIGS]
                         + [(n, lay) for n in RESHARDED for lay in ("tp2", "pp2")])
def test_import_matches_megatron_logits(mcore, tmp_path, name, layout_):
    out = str(tmp_path / "ck")
    assert convert(["import", os.path.join(mcore, name, layout_), out]) == 0
    meta = json.load(open(os.path.join(out, "step-0", "meta.json")))
    assert meta["model_name"] == ("llama3" if name == "llama" else "gpt")
    ref = torch.load(os.path.join(mcore, f"{name}.logits.pt"))
    torch.testing.assert_close(titanlike_logits(out), ref, atol=ATOL, rtol=0)


def test_import_strips_vocab_padding(mcore, tmp_path):
    # The first 100 rows are the real vocabulary: its logits are the padded model's first 100 columns.
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    assert convert(["import", os.path.join(mcore, "llama", "tp2"), full]) == 0
    assert convert(["import", os.path.join(mcore, "llama", "tp2"), cut, "--vocab-size", "100"]) == 0
    tokens = TOKENS % 100
    torch.testing.assert_close(titanlike_logits(cut, tokens), titanlike_logits(full, tokens)[..., :100], atol=0, rtol=0)


def test_export_loads_in_megatron(mcore, tmp_path):
    pairs = []
    for name in CONFIGS:
        ck, exp = str(tmp_path / f"{name}_ck"), str(tmp_path / f"{name}_export")
        assert convert(["import", os.path.join(mcore, name, "td"), ck]) == 0
        assert convert(["export", ck, exp, "--dtype", "float32"]) == 0
        assert open(os.path.join(exp, "latest_checkpointed_iteration.txt")).read() == "0"
        pairs.append(f"{name}={os.path.join(exp, 'iter_0000000')}")
    _run_worker("load", str(tmp_path), ",".join(pairs))
    for name in CONFIGS:
        ref = torch.load(os.path.join(mcore, f"{name}.logits.pt"))
        torch.testing.assert_close(torch.load(tmp_path / f"{name}.export_logits.pt"), ref, atol=ATOL, rtol=0)


def _one_error_line(capsys, *words: str) -> None:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: "), err
    for w in words:
        assert w in err, err


def test_bad_inputs_exit_2(mcore, tmp_path, capsys):
    import shutil

    out = str(tmp_path / "out")
    assert convert(["import", str(tmp_path), out]) == 2  # an empty folder
    _one_error_line(capsys, "not a Megatron checkpoint folder", "--save folder")
    assert convert(["import", os.path.join(mcore, "llama", "td"), out, "--iteration", "9"]) == 2
    _one_error_line(capsys, "iter_0000009 does not exist", "[7]", "--iteration")
    moe = ["--megatron-arg", "num_experts=8"]
    assert convert(["import", os.path.join(mcore, "llama", "td"), out, *moe]) == 2
    _one_error_line(capsys, "--num-experts 8", "dense")
    assert convert(["import", os.path.join(mcore, "llama", "td"), out,
                    "--megatron-arg", "position_embedding_type=mrope"]) == 2
    _one_error_line(capsys, "'mrope' is not supported")
    broken = str(tmp_path / "broken")
    shutil.copytree(os.path.join(mcore, "llama", "tp2"), broken)
    shutil.rmtree(os.path.join(broken, f"iter_{ITER:07d}", "mp_rank_01"))
    assert convert(["import", broken, out]) == 2
    _one_error_line(capsys, "mp_rank_01", "is missing", "TP=2")
    assert not os.path.exists(out)


if __name__ == "__main__":
    def worker_build_and_reshard(out: str) -> None:
        worker_build(out)
        worker_reshard(out)  # fresh spawned processes: the build's one-process group is not theirs

    {"build": worker_build, "reshard": worker_reshard, "build_and_reshard": worker_build_and_reshard,
     "load": worker_load}[sys.argv[1]](*sys.argv[2:])
