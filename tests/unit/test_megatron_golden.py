"""The translator on Megatron-LM launch scripts (tests/unit/golden_megatron/*.sh) against checked-in results beside
them: *.toml (the translation) or *.err (the one line scripts/from_megatron.py refuses it with). The seed*.sh files
are launch blocks copied verbatim from Megatron-LM documents (SOURCES); the others were written for these tests.
Each block then goes through `scripts/train.py --megatron-args` as far as the config check (no training): it loads,
or is refused with the one line in REFUSED_TO_TRAIN. After an intended change of the translation:
UPDATE_GOLDEN=1 pytest this file, then read the diff of the results before committing them."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from models import get_spec
from titanlike.config import ConfigError
from titanlike.config.megatron import MegatronError, to_toml, translate_text
from titanlike.config.megatron_args import load_with_megatron_args
from titanlike.config.validate import validate_model

GOLDEN = Path(__file__).resolve().parent / "golden_megatron"
SOURCES = {  # where the verbatim blocks come from: a skill page on Megatron-LM (000), Megatron-Core skill (001),
    # the Megatron-LM README (002), the Megatron Core user guide (003); section names
    "seed000_quick_start.sh": "000 Quick Start",
    "seed000_core_arguments.sh": "000 Configuration / Core Training Arguments",
    "seed000_pattern1_gpt_2.7b.sh": "000 Pattern 1: Basic GPT Training (train_gpt_basic.sh)",
    "seed000_pattern2_slurm_70b.sh": "000 Pattern 2: Multi-Node Training with SLURM",
    "seed000_example1_pipeline_13b.sh": "000 Example 1: Complete Training Pipeline",
    "seed000_example2_resume.sh": "000 Example 2: Resume from Checkpoint (Run)",
    "seed000_example3_multi_datacenter.sh": "000 Example 3: Multi-Data Center Training",
    "seed001_mcore_example.sh": "001 Quick start: Simple distributed training",
    "seed001_train_llama_70b.sh": "001 Workflow 1 Step 2: train_llama_70b.sh",
    "seed001_moe_mixtral.sh": "001 Workflow 2 Step 2: MoE hyperparameters",
    "seed002_ddp_no_shard.sh": "002 Data Parallelism: Standard DDP",
    "seed003_msc_data.sh": "003 Train from Object Storage",
    "seed003_msc_checkpoints.sh": "003 Save and Load Checkpoints from Object Storage",
    "seed003_disable_msc.sh": "003 Disable MSC",
    "seed003_num_workers.sh": "003 Performance Considerations",
}
WORLD_SIZES = {  # the world size each translated block is written for (its torchrun/SLURM layout)
    "gpt3_345m.sh": 1,
    "gpt2_large_tp2.sh": 4,  # tp 2 x dp 2
    "gpt3_175b_tp8_pp8.sh": 256,  # tp 8 x pp 8 x dp 4
    "llama_8b_tp2_pp2_cp2.sh": 8,
    "seed000_core_arguments.sh": 16,  # 2 nodes x 8: tp 4 x pp 2 x dp 2
    "seed000_pattern1_gpt_2.7b.sh": 8,  # tp 2 x dp 4
    "seed000_pattern2_slurm_70b.sh": 128,  # 16 nodes x 8: tp 8 x pp 4 x dp 4
    "seed000_example1_pipeline_13b.sh": 32,  # 4 nodes x 8: tp 4 x pp 2 x dp 4
    "seed000_example2_resume.sh": 8,
    "seed000_example3_multi_datacenter.sh": 128,
    "seed001_train_llama_70b.sh": 64,  # 8 nodes x 8: tp 4 x pp 4 x dp 4
    "seed001_moe_mixtral.sh": 32,
    "seed002_ddp_no_shard.sh": 8,
    "seed003_msc_data.sh": 1,
    "seed003_msc_checkpoints.sh": 1,
    "seed003_disable_msc.sh": 1,
    "seed003_num_workers.sh": 1,
}
REFUSED_TO_TRAIN = {  # translated (the TOML lists why), but --megatron-args will not train it: the first line's start
    "seed000_example2_resume.sh": "--megatron-args: [... other args ...]: stray words",
    "seed000_example3_multi_datacenter.sh": "--megatron-args: [... model config ...]: stray words",
    "seed001_moe_mixtral.sh": "--megatron-args: --num-experts: a mixture of experts is a flavor of an MoE family",
    "seed003_msc_data.sh": "--megatron-args: --data-path: msc://my-profile/datasets/text_document: titanlike reads "
                           "local files only",
    "seed003_msc_checkpoints.sh": "--megatron-args: --save: msc://my-profile/checkpoints: titanlike writes checkpoints",
    "seed003_num_workers.sh": "--megatron-args: ...: stray words",
}


def test_every_block_is_accounted_for() -> None:
    blocks = sorted(p.name for p in GOLDEN.glob("*.sh"))
    refused = sorted(p.with_suffix(".sh").name for p in GOLDEN.glob("*.err"))
    assert sorted(set(WORLD_SIZES) | set(refused)) == blocks
    assert sorted(SOURCES) == [b for b in blocks if b.startswith("seed")]
    assert len(SOURCES) >= 13


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.glob("*.sh")))
def test_block_translates_or_is_refused_in_one_line(name: str) -> None:
    text = (GOLDEN / name).read_text()
    err, toml_file = GOLDEN / name.replace(".sh", ".err"), GOLDEN / name.replace(".sh", ".toml")
    update = os.environ.get("UPDATE_GOLDEN") == "1"
    try:
        result = to_toml(translate_text(text), header=f"Golden translation of {name} (tests/unit/"
                                                       f"test_megatron_golden.py; UPDATE_GOLDEN=1 rewrites)")
        golden = toml_file
    except MegatronError as e:
        result, golden = f"{e}\n", err
        assert "\n" not in str(e)
    if update:
        golden.write_text(result)
    assert golden.is_file(), f"no {golden.name}: run UPDATE_GOLDEN=1 pytest {Path(__file__).name}"
    assert result == golden.read_text(), f"{name}: the translation changed; UPDATE_GOLDEN=1 to accept it"
    if golden is err:
        return
    if name in REFUSED_TO_TRAIN:
        with pytest.raises(ConfigError) as e:
            load_with_megatron_args([], text, WORLD_SIZES[name])
        assert str(e.value).startswith(REFUSED_TO_TRAIN[name]) and "\n" not in str(e.value), str(e.value)
        return
    cfg, _ = load_with_megatron_args([], text, WORLD_SIZES[name])
    spec = get_spec(cfg.model.name)
    args = spec.flavor_args(cfg.model.flavor, cfg.model.args)
    if cfg.model.n_layers > 0:
        import dataclasses
        args = dataclasses.replace(args, n_layers=cfg.model.n_layers)
    validate_model(spec, args, cfg.parallelism, cfg.model.flavor)  # heads by tp, stages by layers


def test_shape_of_no_named_flavor_is_built_from_the_flags() -> None:
    """36 layers, 1280 wide, 16 heads (GPT2-large's size with 16 heads): a custom gpt shape, not a refusal; a
    Llama-style block (rope, swiglu, RMSNorm, untied, no biases) picks the llama family with Megatron's rope base."""
    t = translate_text("--num-layers 36 --hidden-size 1280 --num-attention-heads 16 --seq-length 1024")
    assert t.values["model"] | {} == {"vocab_pad_multiple": 128, "name": "gpt", "flavor": "gpt2-large",
                                      "args": {"n_heads": 16}}
    assert t.said[0].startswith("family gpt: --position-embedding-type learned_absolute (Megatron's default)")
    t = translate_text("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention "
                       "--num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope "
                       "--untie-embeddings-and-output-weights --disable-bias-linear --ffn-hidden-size 768")
    m = t.values["model"]
    args = get_spec(m["name"]).flavor_args(m["flavor"], m.get("args"))
    assert (m["name"], m.get("n_layers", args.n_layers), args.dim, args.n_heads, args.n_kv_heads, args.rope_theta) == (
        "llama3", 4, 256, 8, 2, 10000.0)
    from models.common.ffn import ffn_hidden_dim
    assert ffn_hidden_dim(args.dim, args.multiple_of, args.ffn_dim_multiplier) == 768
    with pytest.raises(MegatronError, match=r"^the model flags fit no titanlike family: .*no --swiglu"):
        translate_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --position-embedding-type rope")
