"""Speculative decoding with the MTP modules (titanlike/infer/speculative.py, docs/mtp.md): greedy tokens identical
to plain generate() for tiny DeepSeek-V3 and Llama with 1 and 2 MTP depths over a left-padded batch of different
prompt lengths, with the real drafts and with oracle drafts corrupted at chosen depths (so rounds accept all, some
and none of the drafts, differently per row); the acceptance bookkeeping; the one-line refusals. CPU, fp32."""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from tests.unit.test_mtp import build, tiny_deepseek, tiny_llama
from titanlike.infer import generate
from titanlike.infer import speculative
from titanlike.infer.speculative import for_script, mtp_generate

torch.set_num_threads(1)

CASES = [("deepseek_v3", tiny_deepseek, 1), ("deepseek_v3", tiny_deepseek, 2), ("llama3", tiny_llama, 1),
         ("llama3", tiny_llama, 2)]


def _model(family, make, depth):
    args = make(mtp_num_layers=depth, max_seq_len=48)
    return build(family, args, seed=depth).eval(), args.vocab_size


def _prompts(vocab):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 2, 12)]


@pytest.mark.parametrize("family,make,depth", CASES, ids=[f"{c[0]}-d{c[2]}" for c in CASES])
def test_greedy_equals_plain_generate(family, make, depth):
    model, vocab = _model(family, make, depth)
    prompts = _prompts(vocab)
    want = generate(model, prompts, max_new_tokens=20)
    got, stats = mtp_generate(model, prompts, max_new_tokens=20)
    assert got == want
    assert stats.committed == 3 * 20 and stats.rounds >= 20 // (depth + 1)  # all rows' tokens, prefill included
    assert stats.drafted > 0 and 0 <= stats.accepted <= stats.matched <= stats.drafted
    assert sum(stats.rows_drafted) == stats.drafted and sum(stats.rows_accepted) == stats.accepted
    assert stats.row_forwards <= 3 * (stats.rounds + 1) and stats.tokens_per_forward >= 1
    # fewer drafts than depths, and EOS / streaming as generate() gives them
    eos = want[1][5]
    streamed = []
    got = mtp_generate(model, prompts, max_new_tokens=20, eos_id=eos, draft_tokens=1,
                       on_token=lambda r, t: streamed.append((r, t)))[0]
    assert got == generate(model, prompts, max_new_tokens=20, eos_id=eos)
    assert sorted(streamed) == sorted((r, t) for r, row in enumerate(got) for t in row)


@pytest.mark.parametrize("family,make,depth", CASES, ids=[f"{c[0]}-d{c[2]}" for c in CASES])
def test_oracle_drafts_accept_and_roll_back(family, make, depth, monkeypatch):
    """Drafts from the plain greedy continuation, wrong in one row at one depth in some rounds: rounds then accept
    every draft, some, or none, and the rejected blocks' K/V is overwritten; the tokens stay the greedy ones."""
    model, vocab = _model(family, make, depth)
    prompts = _prompts(vocab)
    want = generate(model, prompts, max_new_tokens=24)
    real = speculative._Drafter.draft
    rounds = []
    longest = max(map(len, prompts))

    def oracle(self, seq, n, n_host, k):
        real(self, seq, n, n_host, k)  # keep the MTP caches' bookkeeping exercised
        out = _truth(want, n_host, longest, k)
        r = len(rounds)
        rounds.append(k)
        if k == 0:  # the last token: nothing to draft
            return out.long()
        if r % 3 == 1:  # one row wrong at the last depth: it accepts k-1, the others k
            out[r % len(prompts), k - 1] = (out[r % len(prompts), k - 1] + 1) % vocab
        elif r % 3 == 2:  # every row wrong at depth 1: nothing accepted
            out[:, 0] = (out[:, 0] + 1) % vocab
        return out

    monkeypatch.setattr(speculative._Drafter, "draft", oracle)
    got, stats = mtp_generate(model, prompts, max_new_tokens=24)
    assert got == want
    assert 0 < stats.accepted < stats.drafted
    assert stats.rounds < 23  # some rounds committed several tokens


def _truth(want, n_host, longest, k):
    """[B, k] each row's greedy tokens after its slot n (tokens already generated before it: n - longest)."""
    return torch.tensor([[row[n - longest + j] if n - longest + j < len(row) else 0 for j in range(1, k + 1)]
                         for row, n in zip(want, n_host)]).long()


@pytest.mark.parametrize("family,make,depth", CASES, ids=[f"{c[0]}-d{c[2]}" for c in CASES])
def test_rows_commit_their_own_drafts(family, make, depth, monkeypatch):
    """Oracle drafts, right every round for row 0, wrong at depth 1 for row 1 and (depth 2) at depth 2 for row 2:
    each row commits its own count per round, so row 0 finishes in a few rounds while row 1 takes one token per
    round, and every row's tokens are still plain greedy's."""
    model, vocab = _model(family, make, depth)
    prompts = _prompts(vocab)
    new = 24
    want = generate(model, prompts, max_new_tokens=new)
    real = speculative._Drafter.draft
    longest = max(map(len, prompts))

    def oracle(self, seq, n, n_host, k):
        real(self, seq, n, n_host, k)
        out = _truth(want, n_host, longest, k)
        if k:
            out[1, 0] = (out[1, 0] + 1) % vocab
        if k > 1:
            out[2, 1] = (out[2, 1] + 1) % vocab
        return out

    monkeypatch.setattr(speculative._Drafter, "draft", oracle)
    got, stats = mtp_generate(model, prompts, max_new_tokens=new)
    assert got == want
    acc, drafted = stats.rows_accepted, stats.rows_drafted
    assert acc[1] == 0 and stats.rounds == new - 1  # row 1 commits one token per round
    # row 0 commits depth + 1 tokens per round (its last round cut at max_new_tokens) and then stops drafting:
    # aligned rows would have committed one per round, row 1's count
    fast = -(-(new - 1) // (depth + 1))  # its rounds
    assert drafted[0] == depth * fast and acc[0] == new - 1 - fast and drafted[0] < drafted[1]
    if depth == 2:  # row 2 accepts its depth-1 draft every round: two tokens per round
        slow = -(-(new - 1) // 2)
        assert drafted[2] == 2 * slow and acc[2] == new - 1 - slow
    else:
        assert (drafted[2], acc[2]) == (drafted[0], acc[0])
    assert stats.committed == 3 * new and stats.accepted == sum(acc) and stats.drafted == sum(drafted)


def test_refusals_are_one_line():
    plain = build("llama3", tiny_llama())
    with_mtp, _ = _model("llama3", tiny_llama, 2)
    cases = [
        (lambda: mtp_generate(plain, [[1, 2]], max_new_tokens=4), "has none"),
        (lambda: for_script("mtp", plain, 0.0, False, print), "mtp_num_layers >= 1"),
        (lambda: mtp_generate(with_mtp, [[1, 2]], max_new_tokens=4, temperature=0.7), "greedy only"),
        (lambda: for_script("mtp", with_mtp, 0.0, True, print), "drop --compile"),
        (lambda: mtp_generate(with_mtp, [[1, 2]], max_new_tokens=4, draft_tokens=3), "between 1 and 2"),
    ]
    for call, text in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert text in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_script_flag_on_a_training_run(tmp_path, capsys):
    """scripts/generate.py --speculative mtp on a run trained with two MTP depths: the same tokens as without the
    flag, the acceptance rate on stderr; sampling with it is refused in one line."""
    import subprocess
    import sys

    from tests.launch import REPO_ROOT
    from tests.unit.test_generate import _load_script

    p = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), "--training.steps=2",
                        "--training.seq_len=32", "--training.local_batch_size=2", "--training.device=cpu",
                        "--checkpoint.enable", "--checkpoint.interval=2", "--metrics.enable_tensorboard=false",
                        "--model.args={mtp_num_layers = 2}", f"--job.dump_folder={tmp_path}", "--job.run_name=mtp"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    script, run = _load_script(), str(tmp_path / "mtp")
    outs = []
    for extra in ([], ["--speculative", "mtp"]):
        assert script.main([run, "--tokens", "5,6,7", "--tokens", "9", "--max-new-tokens", "10", *extra]) == 0
        outs.append(capsys.readouterr())
    assert outs[0].out == outs[1].out
    assert "speculative mtp: accepted" in outs[1].err and "speculative" not in outs[0].err
    assert script.main([run, "--tokens", "5", "--speculative", "mtp", "--temperature", "0.5",
                        "--max-new-tokens", "4"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "greedy only" in lines[0], lines
