"""Resharding-aware data resume on gloo: 2 -> 1 and 1 -> 2 ranks continue at the same global sample, none repeated
or skipped (sample ids compared); the Trainer trains and validates on indexed data under FSDP."""
import numpy as np
import torch

from tests.launch import REPO_ROOT, run_torchrun
from titanlike.config.sections import Data
from titanlike.data import IndexedDatasetWriter, build_dataloader, build_dataset

WORKER = REPO_ROOT / "tests/multiproc/data_reshard_worker.py"


def _write(prefix, seed, docs=300):
    rng = np.random.default_rng(seed)
    w = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(docs):
        w.add_document(np.append(rng.integers(0, 255, rng.integers(4, 60)), 255))  # 255 = EOD
    w.finalize()


def test_reshard_2_to_1_and_1_to_2(tmp_path):
    data, cache, out = tmp_path / "data", str(tmp_path / "cache"), tmp_path / "out"
    out.mkdir()
    _write(str(data / "a"), 1)
    _write(str(data / "b"), 2)
    cfg = Data(dataset="indexed", paths=[f"0.3 {data}/a 0.7 {data}/b"], split="90,10,0", cache_dir=cache)
    ref = build_dataset(cfg, None, seq_len=16, seed=7, vocab_size=256)
    ids = {tuple(ref[i][0].tolist()): i for i in range(64)}  # sample content -> global position
    assert len(ids) == 64

    def one_rank(local_batch_size):
        return build_dataloader(cfg, None, dp_rank=0, dp_degree=1, local_batch_size=local_batch_size, seq_len=16,
                                seed=7, vocab_size=256)

    def to_ids(batches):
        return [ids[tuple(row.tolist())] for b in batches for row in b]

    dl = one_rank(4)  # 1 rank x 4 = the same micro-batch as 2 ranks x 2
    it = iter(dl)
    first_1rank = [next(it)[0] for _ in range(3)]
    torch.save(dl.state_dict(), tmp_path / "state_1rank.pt")

    res = run_torchrun(WORKER, 2, args=[data, cache, tmp_path / "state_1rank.pt", out], timeout=180)
    assert "VALID_LOSS" in res.stdout + res.stderr

    # 2 -> 1, with twice the accumulation (local batch 2 on one rank): the next 12 global samples follow exactly
    a = [torch.load(out / f"a_rank{r}.pt", weights_only=False) for r in range(2)]
    before = to_ids(a[0]["rows"]) + to_ids(a[1]["rows"])
    dl = one_rank(2)
    dl.load_state_dict(a[0]["state"])
    it = iter(dl)
    after = to_ids([next(it)[0] for _ in range(6)])
    assert sorted(before) == list(range(12)) and after == list(range(12, 24))

    # 1 -> 2: the two ranks' next 4 micro-batches are global samples 12..27, split between them
    b = [torch.load(out / f"b_rank{r}.pt", weights_only=False)["rows"] for r in range(2)]
    assert to_ids(first_1rank) == list(range(12))
    got = to_ids(b[0]) + to_ids(b[1])
    assert sorted(got) == list(range(12, 28)) and len(set(got)) == 16
