"""scripts/from_megatron.py + titanlike/config/megatron.py: Megatron flag blocks -> TOML that load_config reads."""
from __future__ import annotations

import importlib.util
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titanlike.config.load import load_config
from titanlike.config.megatron import MegatronError, parse, to_toml, tokenize, translate

ROOT = Path(__file__).resolve().parents[2]

# The seeds' flag blocks, shared with the golden tests (tests/unit/golden_megatron/): GPT-3 345M on one GPU (seed
# 004's 00_train_gpt3_345m.sh), seed 004's GPT2-large with TP 2 + sequence parallel, a Llama-style 8B block.
GOLDEN = ROOT / "tests" / "unit" / "golden_megatron"
GPT3_345M = (GOLDEN / "gpt3_345m.sh").read_text()
GPT2_LARGE = (GOLDEN / "gpt2_large_tp2.sh").read_text()
LLAMA = (GOLDEN / "llama_8b_tp2_pp2_cp2.sh").read_text()


def _load(t, tmp_path: Path, world_size: int):
    path = tmp_path / "run.toml"
    path.write_text(to_toml(t))
    return load_config(["--config", str(path)], world_size=world_size)


def _unmapped(t) -> dict[str, str]:
    return dict(t.unmapped)


def test_gpt3_345m(tmp_path: Path) -> None:
    t = translate(parse(tokenize(GPT3_345M)))
    cfg = _load(t, tmp_path, world_size=1)
    assert (cfg.model.name, cfg.model.flavor, cfg.model.n_layers) == ("gpt", "gpt2-medium", -1)
    assert (cfg.training.local_batch_size, cfg.training.global_batch_size, cfg.training.seq_len) == (4, 8, 1024)
    assert cfg.training.steps == 500000 and cfg.training.max_norm == 1.0
    assert cfg.lr_scheduler.min_lr_factor == pytest.approx(1e-5 / 1.5e-4)
    assert cfg.lr_scheduler.warmup_steps == 5000 and cfg.lr_scheduler.decay_type == "cosine"
    assert cfg.optimizer.weight_decay == 0.01
    assert cfg.data.dataset == "indexed"
    assert cfg.data.paths == ["0.3", "/data/wiki_text_document", "0.7", "/data/books_text_document"]
    assert (cfg.data.vocab_file, cfg.data.split) == ("/data/gpt2-vocab.json", "949,50,1")
    assert (cfg.metrics.log_freq, cfg.checkpoint.interval, cfg.checkpoint.enable) == (100, 10000, True)
    assert (cfg.validation.enable, cfg.validation.interval, cfg.validation.steps) == (True, 1000, 10)
    assert cfg.job.dump_folder == "/ckpt/gpt3-345m"
    assert cfg.training.mixed_precision_param == "float16" and cfg.loss_scaling.static_scale == 0  # dynamic
    assert cfg.metrics.log_format == "megatron" and cfg.training.seed == 1234  # Megatron's default seed
    un = _unmapped(t)
    assert "--fp16" not in un
    assert "320000" not in un["--lr-decay-iters"] and "training.steps" in un["--lr-decay-iters"]
    assert "Megatron checkpoints" in un["--load"]


def test_gpt2_large(tmp_path: Path) -> None:
    t = translate(parse(tokenize(GPT2_LARGE)))
    cfg = _load(t, tmp_path, world_size=4)  # tp 2 * dp 2
    assert (cfg.model.name, cfg.model.flavor) == ("gpt", "gpt2-large")
    assert cfg.model.args == {"attn_dropout": 0.1, "hidden_dropout": 0.1}  # the block's dropout, on the flavor
    assert (cfg.parallelism.tp, cfg.parallelism.enable_sequence_parallel) == (2, True)
    assert cfg.training.mixed_precision_param == "bfloat16" and cfg.model.attn_backend == "flash"
    assert cfg.optimizer.betas == [0.9, 0.95] and cfg.optimizer.eps == 1e-8 and cfg.training.seed == 1234
    assert cfg.activation_checkpoint.mode == "full"
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer" and cfg.data.merge_file == "merges.txt"
    notes = dict(t.notes)
    assert "FSDP" in notes["--use-distributed-optimizer"] and "--lr-decay-iters" in notes
    assert "--distributed-backend" in notes and "--no-masked-softmax-fusion" in notes
    un = _unmapped(t)
    assert un["--recompute-method"] and "--attention-dropout" not in un and "--init-method-std" not in un


def test_llama_block(tmp_path: Path) -> None:
    t = translate(parse(tokenize(LLAMA)))
    cfg = _load(t, tmp_path, world_size=8)  # tp 2 * pp 2 * cp 2
    assert (cfg.model.name, cfg.model.flavor, cfg.model.n_layers) == ("llama3", "8B", -1)
    # no --rotary-base: Megatron's 10000, not the flavor's 500000
    assert cfg.model.args == {"rope_theta": 10000.0, "use_scaled_rope": False}
    assert (cfg.parallelism.tp, cfg.parallelism.pp, cfg.parallelism.cp) == (2, 2, 2)
    assert cfg.parallelism.pp_layers_per_stage == 4 and cfg.parallelism.pp_schedule == "Interleaved1F1B"
    assert (cfg.data.tokenizer_type, cfg.data.tokenizer_model) == ("HuggingFaceTokenizer", "/tok/llama3")
    assert cfg.training.seq_len == 8192
    assert "--untie-embeddings-and-output-weights" not in _unmapped(t)  # the family's own choice


def test_off_flavor_shape_is_the_closest_flavor_with_model_args() -> None:
    t = translate(parse(["--num-layers", "30", "--hidden-size", "1300", "--num-attention-heads", "20"]))
    assert t.values["model"] == {"name": "gpt", "flavor": "gpt2-large", "n_layers": 30, "vocab_pad_multiple": 128,
                                 "args": {"dim": 1300}}
    assert not t.required() and "flavor gpt2-large with model.args {dim = 1300}" in t.said[-1]


def test_unknown_and_unmappable_are_listed() -> None:
    flags = ["--foo-bar", "3", "--no-async-tensor-model-parallel-allreduce", "--num-experts", "8",
             "--moe-router-topk", "2", "$EXTRA_ARGS", "--tensorboard-dir", "tb"]
    t = translate(parse(flags))
    un = _unmapped(t)
    for flag in [f for f in flags if f.startswith(("--", "$"))]:
        assert un.get(flag), flag
    assert "unknown" in un["--foo-bar"] and "a shell variable" in un["$EXTRA_ARGS"]
    assert "# unmapped: --foo-bar:" in to_toml(t)
    assert {f for f, _ in t.required()} == {"$EXTRA_ARGS", "--num-experts", "--moe-router-topk"}


def test_fp16_loss_scaling_flags(tmp_path: Path) -> None:
    flags = ["--fp16", "--loss-scale", "128", "--initial-loss-scale", "65536", "--min-loss-scale", "2",
             "--loss-scale-window", "500.0", "--hysteresis", "3"]
    t = translate(parse(flags))
    assert t.values["loss_scaling"] == {"static_scale": 128.0, "initial_scale": 65536.0, "min_scale": 2.0,
                                        "window": 500, "hysteresis": 3}
    assert t.unmapped == [] and t.values["training"]["mixed_precision_param"] == "float16"
    cfg = _load(t, tmp_path, world_size=1)
    assert (cfg.loss_scaling.static_scale, cfg.loss_scaling.window) == (128.0, 500)
    notes = dict(translate(parse(["--bf16", "--loss-scale", "8"])).notes)
    assert "only acts with --fp16" in notes["--loss-scale"]


@pytest.mark.parametrize("flags,message", [
    ("--fp16 --bf16", "--fp16 and --bf16 contradict each other"),
    ("--fp16 --loss-scale 0", "--loss-scale 0 must be > 0; leave it out for dynamic loss scaling"),
    ("--fp16 --loss-scale -4", "--loss-scale -4 must be > 0"),
    ("--fp16 --min-loss-scale 1e12", "--min-loss-scale 1e+12 is above --initial-loss-scale 4.29497e+09"),
    ("--fp16 --min-loss-scale 64 --initial-loss-scale 32", "--min-loss-scale 64 is above --initial-loss-scale 32"),
    ("--fp16 --hysteresis 0", "--hysteresis 0 must be >= 1"),
    ("--fp16 --loss-scale-window 0", "--loss-scale-window 0 must be >= 1"),
])
def test_contradictions_are_one_line_errors(flags: str, message: str) -> None:
    with pytest.raises(MegatronError) as e:
        translate(parse(tokenize(flags)))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_megatron_defaults_fill_flags_left_out() -> None:
    t = translate(parse(["--lr", "1e-3", "--adam-beta1", "0.8"]))
    assert t.values["lr_scheduler"] == {"decay_type": "linear", "min_lr_factor": 0.0, "warmup_steps": 0}
    assert t.values["optimizer"] == {"lr": 1e-3, "betas": [0.8, 0.999], "weight_decay": 0.01}
    assert (t.values["training"]["seed"], t.values["metrics"]["log_freq"]) == (1234, 100)
    t = translate(parse(["--lr-warmup-fraction", "0.1", "--train-iters", "50", "--min-lr", "0", "--lr", "1"]))
    assert t.values["lr_scheduler"]["warmup_steps"] == 5 and t.values["lr_scheduler"]["min_lr_factor"] == 0.0


def test_missing_value_is_an_error() -> None:
    with pytest.raises(MegatronError, match="--lr needs a value"):
        parse(["--lr", "--bf16"])


def test_script_end_to_end(tmp_path: Path, capsys, monkeypatch) -> None:
    script = [sys.executable, str(ROOT / "scripts" / "from_megatron.py")]
    flags = tmp_path / "flags.sh"
    flags.write_text(GPT3_345M)
    out = tmp_path / "run.toml"
    r = subprocess.run(script + [str(flags), "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "unmapped: --load: Megatron checkpoints" in r.stderr and r.stdout == ""
    assert load_config(["--config", str(out)], world_size=1).model.flavor == "gpt2-medium"
    spec = importlib.util.spec_from_file_location("from_megatron", ROOT / "scripts" / "from_megatron.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # the other two ways in, without another interpreter start (torch import: ~4 s)
    assert mod.main(["--", "--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12"]) == 0
    assert 'flavor = "gpt2"' in capsys.readouterr().out
    monkeypatch.setattr(sys, "stdin", io.StringIO("--micro-batch-size 2 --seq-length"))
    assert mod.main([]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "from_megatron: --seq-length needs a value"
    (tmp_path / "empty.sh").write_text("")
    (tmp_path / "garbage.sh").write_text("asdf qwerty %%% ::: --\n")
    for argv, line in (([str(tmp_path / "empty.sh")], "no pretrain_gpt.py launch and no --flags found"),
                       ([str(tmp_path / "garbage.sh")], "no pretrain_gpt.py launch and no --flags found"),
                       (["/nonexistent"], "cannot read /nonexistent: No such file or directory"),
                       (["--", "--num-layers", "abc"], "--num-layers 'abc': expected a whole number"),
                       (["--bogus"], "unknown option --bogus")):
        assert mod.main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith(f"from_megatron: {line}"), err
    assert mod.main(["--help"]) == 0 and "usage" not in capsys.readouterr().err
    assert mod.main(["--", "--micro-batch-size", "2"]) == 0  # no model flags: said on stderr, in one line
    assert capsys.readouterr().err == ("model: no model-shape flags (--num-layers, --hidden-size, "
                                       "--num-attention-heads): the model is the config's (without --config: "
                                       "llama3's debug flavor)\n")


def test_docs_table_is_true_to_the_code() -> None:
    from titanlike.config import megatron as m
    doc = (ROOT / "docs" / "megatron.md").read_text()
    for flag, (key, _) in m._PLAIN.items():
        assert f"| `{flag}` | `{key}` |" in doc, flag
    for flag, (key, _) in m._SWITCHES.items():
        assert f"| `{flag}` | `{key} = " in doc, flag
    for flag in [*m._NOTED, *m._WHY, *m.megatron_model.VALUED, *m.megatron_model.SWITCHES]:
        assert f"| `{flag}` |" in doc, flag
    for flag, (key, value) in m.DEFAULTS.items():
        assert f"| `{flag}` | `{key} = {m._toml_value(value)}` |" in doc, flag


def test_vocab_padding_follows_megatron(tmp_path: Path) -> None:
    """Megatron pads the vocabulary to --make-vocab-size-divisible-by (128) x TP: GPT-2's 50257 -> 50304 at TP 1;
    the trainer rounds the tokenizer's size up to model.vocab_pad_multiple."""
    t = translate(parse(["--tensor-model-parallel-size", "4", "--make-vocab-size-divisible-by", "64"]))
    assert t.values["model"]["vocab_pad_multiple"] == 256
    assert translate(parse(["--seq-length", "8"])).values["model"]["vocab_pad_multiple"] == 128
    with pytest.raises(MegatronError, match="--make-vocab-size-divisible-by 0 must be >= 1"):
        translate(parse(["--make-vocab-size-divisible-by", "0"]))
    from titanlike.config.load import config_from_dict
    from titanlike.train.trainer import Trainer

    cfg = config_from_dict({"job": {"dump_folder": str(tmp_path)}, "model": {"vocab_pad_multiple": 128},
                            "training": {"steps": 1, "seq_len": 16, "local_batch_size": 1, "device": "cpu"},
                            "data": {"dataset": "stdlib", "tokenizer": "builtin"},
                            "metrics": {"enable_tensorboard": False}})
    trainer = Trainer(cfg)
    try:
        assert trainer.model_args.vocab_size % 128 == 0
        assert 0 <= trainer.model_args.vocab_size - trainer.tokenizer.vocab_size < 128
    finally:
        trainer.close()


def test_model_args_change_the_flavor_and_bad_ones_are_one_line(tmp_path: Path) -> None:
    """model.args: a shape no named flavor has (what the translator writes for off-flavor Megatron shapes)."""
    import models
    from titanlike.config import ConfigError

    cfg = load_config(["--config", str(ROOT / "configs" / "gpt2_debug.toml"), "--model.args={n_heads = 8}"])
    assert cfg.model.args == {"n_heads": 8}
    args = models.get_spec("gpt").flavor_args(cfg.model.flavor, cfg.model.args)
    assert (args.dim, args.n_heads, args.head_dim) == (128, 8, 16)
    (tmp_path / "a.toml").write_text('extends = "%s"\n[model]\nargs = {n_heads = 7}\n' % (ROOT / "configs" /
                                                                                           "gpt2_debug.toml"))
    for argv, message in ((["--config", str(tmp_path / "a.toml")], "dim (128) must be divisible by n_heads (7)"),
                          (["--model.name=gpt", "--model.args={n_headz = 8}"], "model.args.n_headz is not a field"),
                          (["--model.name=gpt", '--model.args={n_heads = "8"}'], "expected a int")):
        with pytest.raises(ConfigError, match=re.escape(message)) as e:
            load_config(argv)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("flags, method", [("--cp-comm-type p2p", "ring"), ("--cp-comm-type a2a", "alltoall"),
                                           ("--cp-comm-type=allgather", "allgather"),
                                           ("--cp-comm-type p2p p2p", "ring")])  # one value per layer, all alike
def test_cp_comm_type_is_the_cp_method(flags: str, method: str, tmp_path: Path) -> None:
    t = translate(parse(tokenize(f"--context-parallel-size 2 --seq-length 64 {flags}")))
    assert "--cp-comm-type" not in _unmapped(t) and "--cp-comm-type" not in dict(t.notes)
    cfg = _load(t, tmp_path, world_size=2)
    assert (cfg.parallelism.cp, cfg.parallelism.cp_method) == (2, method)


def test_cp_comm_type_left_out_or_unmappable() -> None:
    t = translate(parse(tokenize("--context-parallel-size 2")))  # Megatron's default p2p: said, titanlike's kept
    assert "cp_method" not in t.values["parallelism"] and "default is p2p" in dict(t.notes)["--cp-comm-type"]
    assert "--cp-comm-type" not in dict(translate(parse(tokenize("--bf16"))).notes)  # no CP: nothing to say
    un = _unmapped(translate(parse(tokenize("--context-parallel-size 2 --cp-comm-type p2p a2a"))))
    assert un["--cp-comm-type"].startswith("p2p a2a: one method per layer")
    un = _unmapped(translate(parse(tokenize("--context-parallel-size 2 --cp-comm-type a2a+p2p"))))
    assert "hierarchical" in un["--cp-comm-type"]
