"""Config loading (TOML + extends + CLI), validation rules, shipped configs, and TOML round-trip. No torch needed."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from models import get_spec
from titanlike.config import (
    DEFAULT_CONFIG, ConfigError, JobConfig, config_from_dict, config_to_dict, config_to_toml, load_config, split_flags,
    validate, validate_model,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# The world sizes each shipped config is written for; a new config must be added here.
WORLD_SIZES = {
    "debug_model.toml": [1, 2],
    "dpo_debug.toml": [1, 2],
    "dpo_pack_debug.toml": [1, 2],
    "sft_debug.toml": [1, 2],
    "base_gpu.toml": [1],
    "llama3_1b.toml": [1],
    "llama3_1b_long.toml": [1, 2],
    "llama3_8b.toml": [8, 2],
    "llama3_8b_2xh200.toml": [2],
    "llama3_70b.toml": [64],
    "llama3_405b.toml": [128],
    "qwen3_debug_moe.toml": [1, 2],
    "nemotron_h_debug.toml": [1, 2],
    "mamba2_debug.toml": [1, 2],
    "nemotron_h_8b.toml": [8],
    "nemotron_h_56b.toml": [32],
    "mamba2_2.7b.toml": [8],
    "nemotron_h_nano3_30b_a3b.toml": [8],
    "qwen3_30b_a3b.toml": [8, 16],
    "qwen3_next_debug.toml": [1, 2],
    "qwen3_next_80b_a3b.toml": [16, 32],
    "mixtral_8x7b.toml": [16, 8],
    "deepseek_v3_debug.toml": [1, 2],
    "deepseek_v3_16b.toml": [8],
    "deepseek_v3_671b.toml": [512],
    "gpt2_debug.toml": [1, 2],
    "bert_debug.toml": [1, 2],
    "vit_debug.toml": [1, 2],
    "llava_debug.toml": [1, 2],
    "llava_wds_debug.toml": [1, 2],
    "vit_l16.toml": [1],
    "llava_1b.toml": [1],
    "bert_megatron_debug.toml": [1, 2],
    "t5_megatron_debug.toml": [1, 2],
    "bert_base.toml": [8],
    "bert_large.toml": [8, 16],
    "t5_debug.toml": [1, 2],
    "t5_base.toml": [8],
    "t5_large.toml": [8, 16],
    "gpt3_345m.toml": [1, 8],
    "gpt2_large.toml": [1],
    "gpt2_large_dp2.toml": [2],
    "gpt2_large_tp2.toml": [2],
    "gpt2_large_sp2.toml": [2],
    "gpt2_large_cp2.toml": [2],
    "gpt2_large_pp2.toml": [2],
    "gpt3_2.7b.toml": [8],
    "gpt3_175b.toml": [256],
    "llama3_70b_tp4_pp4.toml": [64],
    "llama3_70b_tp8_pp2.toml": [64],
}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def load(*argv: str, world_size: int | None = None) -> JobConfig:
    return load_config(list(argv), world_size=world_size)


def with_changes(**sections) -> JobConfig:
    """JobConfig defaults with {section: {key: value}} applied (type-checked)."""
    return config_from_dict(sections)


# ------------------------------------------------------------------------------------------------ loading

def test_defaults_load():
    assert validate(JobConfig()) is None
    cfg = load()
    assert cfg == load("--config", str(DEFAULT_CONFIG))
    assert (cfg.model.name, cfg.model.flavor, cfg.data.dataset, cfg.data.tokenizer) == (
        "llama3", "debugmodel", "stdlib", "builtin")
    assert (cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps) == (128, 8, 60)
    assert cfg.optimizer.lr == 1e-3 and cfg.lr_scheduler.warmup_steps == 5
    assert cfg.job.run_name == "debug_model"  # "" = the config file's stem


def test_extends_inherits_merges_and_overrides(tmp_path):
    write(tmp_path / "base.toml", '[training]\nsteps = 50\nseq_len = 64\n[optimizer]\nlr = 0.01\n')
    write(tmp_path / "mid.toml", 'extends = "base.toml"\n[training]\nseq_len = 32\n')
    child = write(tmp_path / "sub" / "child.toml",
                  'extends = "../mid.toml"\n[optimizer]\nbetas = [0.8, 0.9]\n[job]\nrun_name = "c"\n')
    cfg = load("--config", str(child))
    assert cfg.training.steps == 50  # from base, through mid
    assert cfg.training.seq_len == 32  # mid overrides base
    assert cfg.optimizer.lr == 0.01 and cfg.optimizer.betas == [0.8, 0.9]  # tables merge key by key
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size
    assert cfg.job.run_name == "c"


def test_extends_cycle_and_missing(tmp_path):
    write(tmp_path / "a.toml", 'extends = "b.toml"\n')
    write(tmp_path / "b.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="extends cycle"):
        load("--config", str(tmp_path / "a.toml"))
    write(tmp_path / "c.toml", 'extends = "nope.toml"\n')
    with pytest.raises(ConfigError, match=r"extends 'nope.toml'.*nope.toml was not found"):
        load("--config", str(tmp_path / "c.toml"))
    write(tmp_path / "d.toml", "extends = 3\n")
    with pytest.raises(ConfigError, match="must be a file name"):
        load("--config", str(tmp_path / "d.toml"))


@pytest.mark.parametrize("argv, key, expected", [
    (["--training.steps=7"], "training.steps", 7),
    (["--training.steps", "7"], "training.steps", 7),
    (["--parallelism.dp_shard", "-1"], "parallelism.dp_shard", -1),
    (["--optimizer.lr=2e-4"], "optimizer.lr", 2e-4),
    (["--optimizer.lr", "1"], "optimizer.lr", 1.0),
    (["--compile.enable"], "compile.enable", True),
    (["--compile.enable=false"], "compile.enable", False),
    (["--compile.enable", "0"], "compile.enable", False),
    (["--compile.enable=1"], "compile.enable", True),
    (["--compile.enable", "--training.steps=9"], "compile.enable", True),
    (["--compile.components=model"], "compile.components", ["model"]),
    (["--compile.components=loss,model"], "compile.components", ["loss", "model"]),
    (["--compile.components", "[model, loss]"], "compile.components", ["model", "loss"]),
    (["--float8.filter_fqns=[]"], "float8.filter_fqns", []),
    (["--optimizer.betas=0.8,0.99"], "optimizer.betas", [0.8, 0.99]),
    (["--model.flavor=1B"], "model.flavor", "1B"),
    (["--model.flavor", "8B"], "model.flavor", "8B"),
    (["--job.description='a b'"], "job.description", "a b"),
    (["--training.seq-len=64"], "training.seq_len", 64),  # dashes accepted for underscores
    (["--training.steps=7", "--training.steps=8"], "training.steps", 8),  # last one wins
])
def test_cli_overrides(argv, key, expected):
    section, name = key.split(".")
    value = getattr(getattr(load(*argv), section), name)
    assert value == expected and type(value) is type(expected)


def test_cli_overrides_beat_toml_wherever_given(tmp_path):
    path = write(tmp_path / "x.toml", "[training]\nsteps = 50\n")
    assert load("--training.steps=20", "--config", str(path)).training.steps == 20
    assert load(f"--config={path}", "--training.steps", "20").training.steps == 20


def test_split_flags():
    rest, flags = split_flags(["--print-config", "--config", "x.toml", "--debug", "--training.steps=3"])
    assert rest == ["--config", "x.toml", "--training.steps=3"] and flags == {"--print-config", "--debug"}
    with pytest.raises(ConfigError, match="unknown command-line argument '--print-config'"):
        load("--print-config")


# ------------------------------------------------------------------------------------------------ load errors

def test_unknown_key_in_toml_names_file_and_suggests(tmp_path):
    path = write(tmp_path / "x.toml", "[training]\nsq_len = 5\n")
    with pytest.raises(ConfigError) as e:
        load("--config", str(path))
    assert str(e.value) == f"unknown key 'training.sq_len' in {path}; did you mean 'training.seq_len'?"


@pytest.mark.parametrize("text, message", [
    ("[trainig]\nsteps = 5\n", "unknown section 'trainig'.*did you mean 'training'"),
    ("[training]\nlr = 0.1\n", "unknown key 'training.lr'.*did you mean 'optimizer.lr'"),
    ("seq_len = 5\n", "unknown top-level key 'seq_len'.*did you mean 'training.seq_len'"),
    ('[training]\nseq_len = "4k"\n', r"wrong type for 'training.seq_len' in .*x.toml: expected int, got '4k'"),
    ("[training]\nsteps = 1.5\n", "expected int, got 1.5"),
    ('[compile]\nenable = "yes"\n', "'compile.enable'.*expected bool"),
    ("[optimizer]\nfused = true\n", 'expected str.*write it as a string: fused = "true"'),
    ('[optimizer]\nbetas = [0.9, "x"]\n', r"'optimizer.betas\[1\]'.*expected float"),
    ("[compile]\ncomponents = \"model\"\n", "expected list of str"),
    ("training = 3\n", "must be a table"),
])
def test_toml_errors(tmp_path, text, message):
    path = write(tmp_path / "x.toml", text)
    with pytest.raises(ConfigError, match=message):
        load("--config", str(path))


@pytest.mark.parametrize("argv, message", [
    (["--trainig.steps=5"], "unknown section 'trainig' on the command line; did you mean 'training'"),
    (["--training.sq_len=5"], "unknown key 'training.sq_len' on the command line; did you mean 'training.seq_len'"),
    (["--seq_len=5"], "did you mean 'training.seq_len'"),
    (["--training.steps=ten"], "wrong type for 'training.steps' on the command line: expected int, got 'ten'"),
    (["--optimizer.lr=fast"], "expected float"),
    (["--compile.enable=maybe"], "expected bool"),
    (["--checkpoint.enable", "maybe"], "^--checkpoint.enable takes true/false, got 'maybe'$"),
    (["--optimizer.betas=0.9,x"], "expected float"),
    (["--training.steps"], "--training.steps needs a value"),
    (["--training.steps", "--optimizer.lr=1"], "needs a value"),
    (["stray"], "unexpected command-line argument 'stray'"),
    (["--config"], "--config needs a file"),
    (["--config=a.toml", "--config=b.toml"], "--config given twice"),
    (["--activation_checkpoint.mode=memory_budget"], "memory_budget\" needs compile.enable=true"),
    (["--activation_checkpoint.mode=memory_budget", "--compile.enable=true",
      "--activation_checkpoint.memory_budget=1.5"], r"activation_checkpoint.memory_budget=1.5 must be within \[0, 1\]"),
    (["--compile.backend=nope"], "compile.backend='nope' is not a torch.compile backend here; use one of inductor"),
])
def test_cli_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        load(*argv)


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found: no/such.toml"):
        load("--config", "no/such.toml")


def test_bad_toml_reports_file_and_line(tmp_path):
    path = write(tmp_path / "bad.toml", "[training]\nsteps = 5\nseq_len = \n")
    with pytest.raises(ConfigError, match=r"invalid TOML in .*bad.toml.*line 3"):
        load("--config", str(path))


# ------------------------------------------------------------------------------------------------ validation

def test_world_size_product():
    cfg = with_changes(parallelism={"dp_shard": 2, "tp": 2})
    validate(cfg, world_size=4)
    with pytest.raises(ConfigError, match=r"pp\*dp_replicate\*dp_shard\*cp\*tp = 1\*1\*2\*1\*2 = 4, but "
                                         r"world_size is 8"):
        validate(cfg, world_size=8)
    with pytest.raises(ConfigError, match="world_size is 8"):
        load("--parallelism.dp_shard=2", "--parallelism.tp=2", world_size=8)


def test_dp_shard_fill():
    cfg = with_changes(parallelism={"tp": 4}, training={"seq_len": 128})
    validate(cfg, world_size=8)  # dp_shard resolves to 2
    with pytest.raises(ConfigError, match=r"dp_shard=-1 fills.*world_size 6 is not divisible by "
                                         r"pp\*dp_replicate\*cp\*tp = 1\*1\*1\*4 = 4"):
        validate(cfg, world_size=6)


def test_context_parallel_rules():
    validate(with_changes(parallelism={"cp": 2}, training={"seq_len": 128}), world_size=4)
    with pytest.raises(ConfigError, match=r"training.seq_len / parallelism.cp = 12 must be divisible by "
                                         r"parallelism.tp=8"):
        validate(with_changes(parallelism={"cp": 2, "tp": 8}, training={"seq_len": 24}), world_size=16)
    with pytest.raises(ConfigError, match=r"model.mask_kernel=\"flex\" cannot train on training.device=\"cpu\""):
        validate(with_changes(model={"mask_kernel": "flex"}, training={"device": "cpu"}), world_size=1)


def test_mixer_kernel_rules(monkeypatch):
    with pytest.raises(ConfigError, match=r"model.mixer_kernel=\"fla\" cannot train on training.device=\"cpu\""):
        validate(with_changes(model={"mixer_kernel": "fla"}, training={"device": "cpu"}), world_size=1)
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # fla-core not installed
    with pytest.raises(ConfigError, match=r"model.mixer_kernel=\"fla\" needs .*pip install 'titanlike\[fla\]'"):
        validate(with_changes(model={"mixer_kernel": "fla"}, training={"device": "cuda"}), world_size=1)
    with pytest.raises(ConfigError, match=r"model.mixer_kernel"):
        validate(with_changes(model={"mixer_kernel": "mamba_ssm"}), world_size=1)


@pytest.mark.parametrize("name, big, other", [
    ("mamba2", "ssm_state_size", {}), ("mamba2", "mamba_head_dim", {"mamba_n_heads": 2}),
    ("nemotron_h", "ssm_state_size", {}), ("nemotron_h", "mamba_head_dim", {"mamba_n_heads": 2}),
    ("qwen3_next", "linear_head_k_dim", {}), ("qwen3_next", "linear_head_v_dim", {}),
])
def test_mixer_kernel_fla_refuses_large_heads(monkeypatch, name, big, other):
    """A recurrent mixer size above fla's MAX_HEAD_DIM: "fla" is one line at validation naming both keys and the fix;
    "auto" and "torch" keep the PyTorch scans, so the same sizes validate; MAX_HEAD_DIM itself is taken."""
    import importlib.util

    from models.common.fla_kernels import MAX_HEAD_DIM

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda mod, *a: object() if mod == "fla" else real(mod, *a))
    for size in (MAX_HEAD_DIM, MAX_HEAD_DIM + 64):
        model = {"name": name, "flavor": "debugmodel", "args": {big: size, **other}}
        for kernel in ("fla", "auto", "torch"):
            cfg = with_changes(model={**model, "mixer_kernel": kernel}, training={"device": "cuda"})
            if kernel == "fla" and size > MAX_HEAD_DIM:
                with pytest.raises(ConfigError) as e:
                    validate(cfg, world_size=1)
                assert str(e.value) == (f"model.mixer_kernel=\"fla\": model.args.{big}={size} is above "
                                        f"{MAX_HEAD_DIM}, the largest head size fla's kernels take; use "
                                        f"mixer_kernel=\"auto\" or \"torch\" (the PyTorch scans)")
            else:
                validate(cfg, world_size=1)


@pytest.mark.parametrize("key, value", [
    ("dp_shard", 0), ("dp_shard", -2), ("tp", 0), ("pp", -1), ("cp", 0), ("dp_replicate", 0), ("ep", 0),
])
def test_bad_degrees(key, value):
    with pytest.raises(ConfigError, match=f"parallelism.{key}={value} must be >= 1"):
        validate(with_changes(parallelism={key: value}))


def test_global_batch():
    par = {"dp_replicate": 2, "dp_shard": 2}
    for ok in (-1, 32, 64):
        validate(with_changes(parallelism=par, training={"local_batch_size": 8, "global_batch_size": ok}), 4)
    bad = with_changes(parallelism=par, training={"local_batch_size": 8, "global_batch_size": 40})
    with pytest.raises(ConfigError, match=r"global_batch_size=40 must be -1 or a multiple of local_batch_size\*"
                                         r"dp_degree = 8\*4 = 32.*valid values: -1, 32, 64, 96"):
        validate(bad, world_size=4)
    with pytest.raises(ConfigError, match="multiple of training.local_batch_size=8"):  # world size unknown
        validate(with_changes(training={"local_batch_size": 8, "global_batch_size": 12}))


@pytest.mark.parametrize("section, key, value, message", [
    ("activation_checkpoint", "mode", "fulll", "activation_checkpoint.mode='fulll' is not one of none, full, "
                                               "selective, memory_budget; did you mean 'full'"),
    ("activation_checkpoint", "selective_option", "every", "selective_option='every' must be \"op\""),
    ("activation_checkpoint", "selective_option", "0", "selective_option='0'"),
    ("lr_scheduler", "decay_type", "cos", "lr_scheduler.decay_type='cos' is not one of"),
    ("float8", "recipe", "rowise", "did you mean 'rowwise'"),
    ("checkpoint", "async_mode", "on", "checkpoint.async_mode"),
    ("optimizer", "name", "Adam", "optimizer.name='Adam' is not one of AdamW"),
    ("training", "mixed_precision_impl", "master", "did you mean 'master_weights'"),
    ("optimizer", "fused", "yes", "optimizer.fused='yes' is not one of auto, true, false"),
    ("training", "device", "gpu", "training.device"),
    ("parallelism", "fsdp_reshard_after_forward", "sometimes", "fsdp_reshard_after_forward"),
    ("training", "mixed_precision_param", "bf16", "mixed_precision_param='bf16' is not one of bfloat16"),
    ("training", "mixed_precision_reduce", "fp32", "mixed_precision_reduce"),
    ("compile", "components", ["model", "optimiser"], "compile.components has \\['optimiser'\\]"),
    ("training", "steps", 0, "training.steps=0 must be >= 1"),
    ("training", "seq_len", -5, "training.seq_len=-5 must be >= 1"),
    ("training", "local_batch_size", 0, "training.local_batch_size=0 must be >= 1"),
    ("lr_scheduler", "decay_ratio", 1.5, "decay_ratio=1.5 must be in \\[0, 1\\]"),
    ("lr_scheduler", "min_lr_factor", -0.1, "min_lr_factor=-0.1 must be in \\[0, 1\\]"),
    ("optimizer", "lr", 0.0, "optimizer.lr=0.0 must be > 0"),
    ("optimizer", "betas", [0.9], "optimizer.betas"),
    ("float8", "enable_fsdp_float8_all_gather", True, None),  # fine with the tensorwise default
])
def test_bad_values(section, key, value, message):
    cfg = with_changes(**{section: {key: value}})
    if message is None:
        validate(cfg)
        return
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_feature_rules():
    with pytest.raises(ConfigError, match="needs float8.recipe=\"tensorwise\""):
        validate(with_changes(float8={"recipe": "rowwise", "enable_fsdp_float8_all_gather": True}))
    with pytest.raises(ConfigError, match="seq_len=102 must be divisible by 2\\*parallelism.cp = 4"):
        validate(with_changes(parallelism={"cp": 2}, training={"seq_len": 102}))
    with pytest.raises(ConfigError, match="seq_len=100 must be divisible by parallelism.tp=8"):
        validate(with_changes(parallelism={"tp": 8}, training={"seq_len": 100}))


def test_all_errors_reported_at_once():
    cfg = with_changes(training={"steps": 0}, optimizer={"lr": -1.0}, activation_checkpoint={"mode": "x"})
    with pytest.raises(ConfigError, match="3 config errors") as e:
        validate(cfg)
    for key in ("training.steps", "optimizer.lr", "activation_checkpoint.mode"):
        assert key in str(e.value)


def check_model(spec, args, cfg):
    validate_model(spec, args, cfg.parallelism, cfg.model.flavor)  # the two sections it reads


def test_validate_model_heads_and_tp():
    spec = get_spec("llama3")
    args_8b = spec.flavors["8B"]
    cfg = with_changes(model={"flavor": "8B"}, parallelism={"tp": 3})
    with pytest.raises(ConfigError) as e:
        check_model(spec, args_8b, cfg)
    assert str(e.value) == ("model.flavor '8B' has n_kv_heads=8 which parallelism.tp=3 does not divide; "
                            "use tp in {1,2,4,8}")
    check_model(spec, args_8b, with_changes(parallelism={"tp": 8}))
    mha = spec.args_cls(dim=768, n_layers=4, n_heads=12, vocab_size=100)
    with pytest.raises(ConfigError, match="n_heads=12 which parallelism.tp=8 does not divide; use tp in "
                                          "\\{1,2,3,4,6,12\\}"):
        check_model(spec, mha, with_changes(parallelism={"tp": 8}))
    with pytest.raises(ConfigError, match="parallelism.pp=8 exceeds"):
        check_model(spec, mha, with_changes(parallelism={"pp": 8}))


# ------------------------------------------------------------------------------------------------ shipped configs

@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_validate(path):
    assert path.name in WORLD_SIZES, f"add {path.name} to WORLD_SIZES with the world sizes it is written for"
    for world_size in WORLD_SIZES[path.name]:
        cfg = load("--config", str(path), world_size=world_size)
        spec = get_spec(cfg.model.name)
        assert cfg.model.flavor in spec.flavors
        check_model(spec, spec.flavors[cfg.model.flavor], cfg)


# ------------------------------------------------------------------------------------------------ round trip

@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_toml_round_trip_of_shipped_configs(tmp_path, path):
    cfg = load("--config", str(path), "--training.seq_len=512")
    out = write(tmp_path / "resolved.toml", config_to_toml(cfg, header=f"resolved from {path.name}\nline two"))
    again = load("--config", str(out))
    assert again == cfg and config_to_dict(again) == config_to_dict(cfg)


def test_toml_round_trip_of_awkward_values(tmp_path):
    cfg = JobConfig()
    cfg.job.description = 'quote " backslash \\ tab \t newline \n unicode é ✓'
    cfg.job.run_name = "r"
    cfg.optimizer.lr = 1.2345678901234567e-05
    cfg.optimizer.eps = 1e-300
    cfg.training.max_norm = float("inf")
    cfg.float8.filter_fqns = []
    out = write(tmp_path / "r.toml", config_to_toml(cfg))
    assert load("--config", str(out)) == cfg
    assert dataclasses.asdict(cfg) == config_to_dict(cfg)


def test_advice_clamps_a_warmup_longer_than_the_run_and_warns_of_long_sequences(tmp_path, caplog):
    """Smoke runs of real configs (--training.steps 30) train with the warmup clamped, saying so once."""
    from titanlike.config.load import load_config

    log = logging.getLogger("titanlike")
    log.addHandler(caplog.handler)
    try:
        cfg = load_config(["--config", str(Path(__file__).resolve().parents[2] / "configs/llama3_8b.toml"),
                           "--training.steps=30", "--training.seq_len=262144"])
    finally:
        log.removeHandler(caplog.handler)
    assert cfg.lr_scheduler.warmup_steps == 30
    assert "warmup_steps=200 exceeds training.steps=30: warming up over all 30 steps" in caplog.text
    assert "seq_len=262144 is longer than the llama3 8B flavor's context (131072)" in caplog.text


def test_empty_config_file_warns_and_dump_folder_file_is_refused(tmp_path, caplog):
    from titanlike.config.load import load_config

    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing yet\n")
    log = logging.getLogger("titanlike")
    log.addHandler(caplog.handler)
    try:
        load_config(["--config", str(empty)])
    finally:
        log.removeHandler(caplog.handler)
    assert f"config file {empty} sets nothing: training llama3 debugmodel on the defaults" in caplog.text
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="job.dump_folder=.*afile' is a file, not a folder"):
        load_config(["--job.dump_folder", str(tmp_path / "afile")])
