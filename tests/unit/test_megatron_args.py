"""scripts/train.py --megatron-args: a Megatron flag block trains directly, the same run as its TOML (CPU, ~10 s)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from titanlike.config import ConfigError
from titanlike.config.megatron import MegatronError
from titanlike.config.megatron_args import load_with_megatron_args, take_block

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "train.py")

# The tiny GPT of configs/gpt2_debug.toml (gpt/debugmodel: 2 layers, 128 wide, 4 heads) as a pasted launch script
BLOCK = r"""python pretrain_gpt.py \
    --num-layers 2 --hidden-size 128 --num-attention-heads 4 \
    --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 4 --train-iters 100 \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 \
    --log-interval 1 --foo-bar 3   # a flag titanlike does not know: listed, not dropped
"""
# What a user would write by hand for the same run (Megatron's defaults spelled out: seed, betas, weight decay)
EQUIVALENT = """
[model]
name = "gpt"
flavor = "debugmodel"

[training]
seq_len = 64
local_batch_size = 4
steps = 100
seed = 1234

[optimizer]
lr = 1e-3
betas = [0.9, 0.999]
weight_decay = 0.01

[lr_scheduler]
warmup_steps = 1
min_lr_factor = 0.1
decay_type = "cosine"

[metrics]
log_freq = 1
log_format = "megatron"
"""


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _losses(p: subprocess.CompletedProcess) -> list[float]:
    # Megatron's iteration line ("lm loss: 7.65E+00 |") or titanlike's ("loss 7.65")
    return [float(x) for x in re.findall(r"(?:lm loss: | loss )([-+.\deE]+\d)", p.stdout + p.stderr)]


def test_megatron_args_trains_like_its_toml(tmp_path: Path) -> None:
    common = [f"--job.dump_folder={tmp_path}", "--training.device=cpu", "--training.steps=3",  # overrides win
              "--metrics.enable_tensorboard=false"]
    a = _train("--megatron-args", BLOCK, *common)
    assert a.returncode == 0, a.stderr[-3000:]
    assert "--megatron-args: unmapped: --foo-bar: unknown to this translator" in a.stdout + a.stderr
    (tmp_path / "equivalent.toml").write_text(EQUIVALENT)
    b = _train("--config", str(tmp_path / "equivalent.toml"), *common)
    assert b.returncode == 0, b.stderr[-3000:]
    assert len(_losses(a)) == 3 and _losses(a) == _losses(b)
    written = (tmp_path / "megatron" / "megatron_args.toml").read_text()
    assert 'flavor = "debugmodel"' in written and "# unmapped: --foo-bar:" in written
    assert "#     --num-layers 2 --hidden-size 128" in written  # the flag block it came from


def test_contradiction_exits_2_with_one_line() -> None:
    p = _train("--megatron-args", "--num-layers 2 --hidden-size 128 --num-attention-heads 4 --fp16 --bf16",
               "--training.steps=1")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("error: --fp16 and --bf16 contradict each other: keep one "
                                                 "(--bf16 needs no loss scaling)")


def test_block_is_one_argument_or_a_file(tmp_path: Path) -> None:
    assert take_block(["--megatron-args", "--lr 1 --bf16", "--training.steps=2"]) == (["--training.steps=2"],
                                                                                    "--lr 1 --bf16")
    assert take_block(["--megatron-args=--bf16"]) == ([], "--bf16")
    (tmp_path / "flags.sh").write_text(BLOCK)
    assert take_block(["--config", "x.toml", "--megatron-args", f"@{tmp_path / 'flags.sh'}"])[1] == BLOCK
    with pytest.raises(ConfigError, match="--hidden-size comes after the flag block: --megatron-args takes the whole "
                                          "flag block as one argument"):
        take_block(["--megatron-args", "--num-layers", "2", "--hidden-size", "128"])
    with pytest.raises(ConfigError, match="cannot read the flag file"):
        take_block(["--megatron-args", f"@{tmp_path / 'nope.sh'}"])
    with pytest.raises(ConfigError, match="needs the flag block"):
        take_block(["--megatron-args"])


def test_flags_that_change_the_model_must_map(tmp_path: Path) -> None:
    cfg, _ = load_with_megatron_args([], "--num-layers 3 --hidden-size 96 --num-attention-heads 6", 1)
    assert (cfg.model.name, cfg.model.n_layers, cfg.model.args) == ("gpt", 3, {"dim": 96, "n_heads": 6})
    with pytest.raises(ConfigError, match=r"--megatron-args: \$DATA_ARGS: a shell variable the script does not set"):
        load_with_megatron_args([], "--lr 1e-3 $DATA_ARGS", 1)
    with pytest.raises(ConfigError, match=r"^--megatron-args: --data-path: '\$DATA_PATH' holds a shell variable"):
        load_with_megatron_args([], "--lr 1e-3 --data-path $DATA_PATH", 1)
    with pytest.raises(MegatronError, match="--lr needs a value"):
        load_with_megatron_args([], "--lr --bf16", 1)


LAUNCH = r"""#!/bin/bash
#SBATCH --nodes=1
export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
TP=1
MODEL_ARGS="--num-layers 2 --hidden-size 128 \
    --num-attention-heads 4"
TRAIN=(--micro-batch-size 2 --train-iters 7)
torchrun --nproc_per_node=1 pretrain_gpt.py $MODEL_ARGS "${TRAIN[@]}" \
    --tensor-model-parallel-size $TP --seq-length 32 --mock-data 2>&1 | tee log.txt
"""


def test_a_whole_launch_script_translates_with_its_variables() -> None:
    """The script's own variables and arrays are expanded; a `|` before the launch does not drop it; --mock-data
    is the mock dataset."""
    cfg, run = load_with_megatron_args([], LAUNCH, 1)
    assert (cfg.model.name, cfg.model.flavor, cfg.parallelism.tp, cfg.training.steps) == ("gpt", "debugmodel", 1, 7)
    assert (cfg.training.local_batch_size, cfg.training.seq_len, cfg.data.dataset) == (2, 32, "mock")
    assert "the shape is flavor gpt/debugmodel" in run.translation.said


@pytest.mark.parametrize("block, message", [
    ("asdf qwerty %%% ::: --", "no pretrain_gpt.py launch and no --flags found"),
    ("", "no pretrain_gpt.py launch and no --flags found"),
    ("--num-layers abc", "--num-layers 'abc': expected a whole number"),
    ("--num-layers 2 --hidden-size 64", "--num-attention-heads is missing"),
])
def test_nothing_to_train_is_refused_in_one_line(block: str, message: str, tmp_path: Path) -> None:
    (tmp_path / "empty.sh").write_text("")
    for given in (block, f"@{tmp_path / 'empty.sh'}") if block == "" else (block,):
        _, text = take_block(["--megatron-args", given])
        with pytest.raises(MegatronError, match=re.escape(message)) as e:
            load_with_megatron_args([], text, 1)
        assert "\n" not in str(e.value)


def test_no_model_flags_say_so() -> None:
    cfg, run = load_with_megatron_args([], "--micro-batch-size 2 --seq-length 32", 1)
    assert run.translation.said == ["no model-shape flags (--num-layers, --hidden-size, --num-attention-heads): "
                                    "the model is the config's (without --config: llama3's debug flavor)"]


def test_config_is_the_base_and_overrides_win(tmp_path: Path) -> None:
    cfg, run = load_with_megatron_args(["--config", str(ROOT / "configs" / "gpt2_debug.toml"),
                                        "--training.seq_len=32"], "--seq-length 64 --micro-batch-size 2", 1)
    assert (cfg.model.name, cfg.training.seq_len, cfg.training.local_batch_size) == ("gpt", 32, 2)
    assert cfg.data.dataset == "stdlib" and cfg.job.run_name == "megatron"
    assert run.toml.splitlines()[1].startswith("extends = ") and "gpt2_debug.toml" in run.toml
