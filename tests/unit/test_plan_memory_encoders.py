"""The memory estimate (titanlike/planner/memory.py) for the encoder families: tiny BERT and T5, on plain token data
and on Megatron's BERT / T5 data (the trace feeds the loader's layout: titanlike/planner/loader_batch.py). Parameter,
gradient and optimizer terms equal the families' exact counts; the decoder length of the T5 data reaches the trace."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import models
from titanlike.config.load import load_config
from titanlike.planner import estimate_memory
from titanlike.planner.build import vocab_and_eod

torch.set_num_threads(1)


def _cfg(tmp_path, config, *extra):
    # (the Megatron configs' vocab.txt need not exist: the estimate then takes the flavor's vocabulary, and says so)
    return load_config([f"--config=configs/{config}", f"--job.dump_folder={tmp_path}", "--training.device=cpu",
                        "--metrics.enable_tensorboard=false", "--compile.enable=false", *extra], world_size=1)


def _exact(cfg):
    """(parameters, parameter tensors) of the run's model by the family's counts (models/*/counts.py)."""
    spec = models.get_spec(cfg.model.name)
    vocab, _ = vocab_and_eod(cfg.model, cfg.data, spec, [])
    args = dataclasses.replace(spec.flavor_args(cfg.model.flavor, cfg.model.args), vocab_size=vocab,
                               max_seq_len=cfg.training.seq_len)
    with torch.device("meta"):
        tensors = len(list(spec.model_cls(args).parameters()))
    return spec.param_counts(args).total, tensors


@pytest.mark.parametrize("config", ["bert_debug.toml", "bert_megatron_debug.toml", "t5_debug.toml",
                                    "t5_megatron_debug.toml"])
def test_terms_equal_the_exact_counts(tmp_path, config):
    cfg = _cfg(tmp_path, config)
    (r,) = estimate_memory(cfg, 1, device_kind="cpu").ranks
    total, tensors = _exact(cfg)
    assert r.parameters == 4 * total  # fp32 on one CPU process
    assert r.gradients == 4 * total
    assert r.optimizer_states == 2 * 4 * total + 4 * tensors  # AdamW's two moments + one fp32 step per tensor
    assert r.activations > 0 and r.peak >= r.parameters + r.gradients + r.optimizer_states
    print(f"{config}: {total:,} params, peak {r.peak / 2**20:.1f} MiB, activations {r.activations / 2**20:.2f} MiB")


def test_t5_data_decoder_length_reaches_the_trace(tmp_path):
    """Megatron's T5 batches are traced in their own layout: a longer data.decoder_seq_length costs activations."""
    short, long = (estimate_memory(_cfg(tmp_path, "t5_megatron_debug.toml", f"--data.decoder_seq_length={sd}",
                                        "--model.args={max_decoder_len = 512}"), 1, device_kind="cpu").ranks[0]
                   for sd in (32, 256))
    assert long.activations > 2 * short.activations, (short.activations, long.activations)
    assert long.parameters == short.parameters
