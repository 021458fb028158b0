"""Preference pairs for DPO (data.dataset = "preference"): JSONL rows {"prompt", "chosen", "rejected"}.

Sample i is pair i as two sequences, `(input_ids [2, S], labels [2, S])`: row 0 the chosen one, row 1 the rejected
one, each the prompt's tokens followed by the response's (ending with EOS, so the model learns to stop) and shifted
by one like every loader's (labels[t] = token t + 1). Labels are IGNORE_INDEX where the target is a prompt token or
padding: the DPO loss sums log-probs over the response only. The loader stacks B samples to [B, 2, S]; the DPO
objective (titanlike/train/dpo.py) flattens that to [2B, S], rows [c0, r0, c1, r1, ...], so a pair is never split
between data-parallel ranks or micro-batches.

Tokenised once at start-up (every rank reads the whole file, as the sample count and fingerprint need). A pair longer
than seq_len + 1 tokens keeps its start (TRL's truncation_mode="keep_start": the response is cut at the end); the
truncations are counted and logged. A pair whose prompt leaves no response token in the window is dropped (counted,
warned). A pair whose chosen and rejected texts are equal carries no preference: refused at build, naming its lines.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import logging

import numpy as np
import torch
from torch.utils.data import Dataset

from models.batch import IGNORE_INDEX

logger = logging.getLogger(__name__)
FIELDS = ("prompt", "chosen", "rejected")


def _open(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def _chat_pair(row: dict, where: str) -> tuple[list[int], list[int], list[int]]:
    """The hook for chat-message pairs (prompt / chosen / rejected as [{"role": ..., "content": ...}, ...]).

    TODO(issue 36): once titanlike/data/chat.py lands (SFT chat data: `render_with_masks(template, messages,
    tokenizer) -> (ids, assistant_mask)`), render prompt + chosen and prompt + rejected as whole conversations and
    take the prompt as the tokens before the first assistant-masked token; return (prompt_ids, chosen_ids,
    rejected_ids) like _encode_pair. Until then such rows are refused in one line."""
    raise ValueError(f"{where}: chat-message pairs (lists of {{role, content}}) are not supported yet: give "
                     f"\"prompt\", \"chosen\" and \"rejected\" as strings (the chat template hook is a TODO in "
                     f"titanlike/data/preference.py)")


class PreferenceDataset(Dataset):
    def __init__(self, files: list[str], tokenizer, seq_len: int, *, add_bos: bool = False, key: str = "data.paths",
                 dp_rank: int = 0):
        self.files, self.seq_len = list(files), int(seq_len)
        self.pad_id = tokenizer.eos_id  # never a target: padding has IGNORE_INDEX labels
        window = self.seq_len + 1  # S inputs + the last label
        digest = hashlib.sha256(f"preference|{tokenizer.fingerprint}|{self.seq_len}|{add_bos}".encode())
        self.sides: list[tuple[np.ndarray, int]] = []  # 2 per pair: (tokens, prompt length), chosen then rejected
        self.file_digests, identical, dropped, cut, rows = [], [], [], 0, 0
        for path in self.files:
            file_digest = hashlib.sha256()
            with _open(path) as f:
                for n, line in enumerate(f, 1):
                    file_digest.update(line.encode("utf-8"))
                    if not line.strip():
                        continue
                    rows += 1
                    where = f"{key}: {path}:{n}"
                    prompt, chosen, rejected = _read_row(line, where)
                    if chosen == rejected:
                        identical.append(f"{path}:{n}")
                        continue
                    p = tokenizer.encode(prompt, bos=add_bos)
                    sides = [np.asarray(p + tokenizer.encode(r, eos=True), dtype=np.int64) for r in (chosen, rejected)]
                    if len(p) >= window:  # no response token left in the window: nothing to prefer
                        dropped.append(f"{path}:{n}")
                        continue
                    cut += sum(len(s) > window for s in sides)
                    self.sides += [(s[:window], len(p)) for s in sides]
            self.file_digests.append(file_digest.hexdigest()[:16])
            digest.update(file_digest.digest())
        if identical:
            raise ValueError(f"{key}: {len(identical)} pair(s) have \"chosen\" equal to \"rejected\" "
                             f"({', '.join(identical[:5])}{', ...' if len(identical) > 5 else ''}): they carry no "
                             f"preference; remove them from the data")
        self.num_pairs = len(self.sides) // 2
        if self.num_pairs == 0:
            raise ValueError(f"{key}: no usable pair in {len(self.files)} file(s) ({rows} rows, {len(dropped)} "
                             f"dropped: prompt longer than training.seq_len={self.seq_len}); raise training.seq_len or "
                             f"give pairs with shorter prompts")
        self.fingerprint = digest.hexdigest()[:16]  # the sampler's and the DPO reference table's identity of the data
        self.truncated, self.dropped = cut, len(dropped)
        if cut:
            logger.info(f"preference data: {cut} of {2 * self.num_pairs} sequences cut to training.seq_len + 1 = "
                        f"{window} tokens (their responses end early)")
        if dropped and dp_rank == 0:
            logger.warning(f"preference data: {len(dropped)} pair(s) dropped, their prompt fills the "
                           f"training.seq_len={self.seq_len} window ({', '.join(dropped[:3])}"
                           f"{', ...' if len(dropped) > 3 else ''}); raise training.seq_len to keep them")

    def __len__(self) -> int:
        return self.num_pairs

    def side(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence j (2i: pair i's chosen, 2i + 1: its rejected) as (input_ids [S], labels [S])."""
        tokens, prompt = self.sides[j]
        s = self.seq_len
        ids = torch.full((s + 1,), self.pad_id, dtype=torch.int64)
        ids[:len(tokens)] = torch.from_numpy(tokens)
        labels = ids[1:].clone()
        labels[:max(prompt - 1, 0)] = IGNORE_INDEX  # labels[t] is token t + 1: a prompt token for t + 1 < prompt
        labels[len(tokens) - 1:] = IGNORE_INDEX  # padding
        return ids[:-1], labels

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.num_pairs:
            raise IndexError(f"pair {i} out of range [0, {self.num_pairs})")
        (ci, cl), (ri, rl) = self.side(2 * i), self.side(2 * i + 1)
        return torch.stack([ci, ri]), torch.stack([cl, rl])

    def sources(self) -> list[list]:
        """[file, content id] per file (titanlike/data/loader_state.py: a resume on other pairs is refused)."""
        return [[f, d] for f, d in zip(self.files, self.file_digests)]

    def summary_lines(self, label: str, samples: int | None, whose: str) -> list[str]:
        tokens = sum(len(t) for t, _ in self.sides)
        epochs = f", {samples / self.num_pairs:,.2f} epochs for {whose} {samples:,} pairs" if samples else ""
        return [f"{label}: preference pairs, {self.num_pairs:,} pairs from {len(self.files)} file(s), {tokens:,} "
                f"tokens (prompt + response, both sides), {self.truncated:,} sequences truncated, {self.dropped:,} "
                f"pairs dropped{epochs}"]


def _read_row(line: str, where: str):
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON object ({e.msg}); each line must be {{\"prompt\": ..., \"chosen\": ..., "
                         f"\"rejected\": ...}}") from None
    if not isinstance(row, dict) or any(k not in row for k in FIELDS):
        have = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{where}: each line needs the fields \"prompt\", \"chosen\" and \"rejected\" (found {have})")
    values = [row[k] for k in FIELDS]
    if not all(isinstance(v, str) for v in values):
        if all(isinstance(v, (str, list)) for v in values):
            _chat_pair(row, where)
        raise ValueError(f"{where}: \"prompt\", \"chosen\" and \"rejected\" must be strings")
    return values


def build_preference_dataset(data_cfg, tokenizer, *, seq_len: int, split: str, paths_key: str = "data.paths",
                             dp_rank: int = 0) -> PreferenceDataset:
    from titanlike.data.streaming import expand_files

    if tokenizer is None:
        raise ValueError("data.dataset='preference' tokenises the pairs and needs a tokenizer")
    if split != "train" and paths_key == "data.paths":  # (validate refuses this config before it gets here)
        raise ValueError("validation of preference data needs validation.paths (JSONL files of held-out pairs): the "
                         "pairs files have no split")
    return PreferenceDataset(expand_files(data_cfg.paths, key=paths_key), tokenizer, seq_len,
                             add_bos=data_cfg.add_bos, key=paths_key, dp_rank=dp_rank)
