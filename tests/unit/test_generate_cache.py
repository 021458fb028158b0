"""A family's own generation cache (ModelSpec.cache, models/cache.py): tests/toy_family/toy_recurrent.py's recurrent
model carries a conv window and a hidden state per layer across forwards, and generate(), which names no cache,
gives the greedy tokens of full forwards over the whole sequence, token for token; left padding, the reset at a
new sequence and the registry lookup of the spec included."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import models
from tests.launch import REPO_ROOT
from titanlike.infer import generate
from titanlike.infer.generate import step_at
from titanlike.infer.load import build_model


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "tests" / "toy_family"))
    import toy_recurrent

    monkeypatch.setitem(models.MODELS, toy_recurrent.SPEC.name, toy_recurrent.SPEC)  # generate finds it by class
    args = dataclasses.replace(toy_recurrent.SPEC.flavors["tiny"], dim=32, n_layers=2, vocab_size=96, max_seq_len=64)
    torch.manual_seed(0)
    return toy_recurrent, build_model(toy_recurrent.SPEC, args, torch.device("cpu"), torch.float32)


@torch.no_grad()
def _greedy_full_forwards(model, prompt: list[int], n: int) -> list[int]:
    seq = torch.tensor([prompt])
    for _ in range(n):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(prompt):].tolist()


def test_recurrent_cache_greedy_equals_full_forwards(toy):
    mod, model = toy
    assert models.spec_of(model) is mod.SPEC
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 3, 6)]  # left-padded into one batch
    want = [_greedy_full_forwards(model, p, 16) for p in prompts]
    got = generate(model, prompts, max_new_tokens=16)
    assert got == want
    assert max(len(set(row)) for row in got) > 3, got  # not a model stuck on one token
    assert all(b.mixer.state is None for b in model.layers.values())  # detached again


def test_recurrent_cache_state_is_carried_and_reset_at_start(toy):
    """Driven by hand: decode logits equal the full forward's at every position (so the state is carried across
    steps, never recomputed), and the same cache object gives the same logits again after Step.start (the compiled
    decode path reuses one cache from call to call)."""
    mod, model = toy
    seq = torch.randint(0, 96, (2, 14), generator=torch.Generator().manual_seed(2))
    prompt, total = 5, seq.shape[1]
    valid = torch.ones(2, total, dtype=torch.bool)
    cache = mod.SPEC.cache(model, 2, total)
    with torch.no_grad():
        want = model(seq)
        for _ in range(2):
            with cache.attached(model):
                cache.set_step(step_at(valid, 0, prompt, prompt))
                got = [model(seq[:, :prompt])]
                for i in range(prompt, total):
                    cache.set_step(step_at(valid, i, 1, i + 1))
                    got.append(model(seq[:, i:i + 1]))
            torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=0, atol=1e-5)
