"""Preference pairs for DPO (data.dataset = "preference"): JSONL rows {"prompt", "chosen", "rejected"}.

Sample i is pair i as two sequences, `(input_ids [2, S], labels [2, S])`: row 0 the chosen one, row 1 the rejected
one, each the prompt's tokens followed by the response's (ending with EOS, so the model learns to stop) and shifted
by one like every loader's (labels[t] = token t + 1). Labels are IGNORE_INDEX where the target is a prompt token or
padding: the DPO loss sums log-probs over the response only. The loader stacks B samples to [B, 2, S]; the DPO
objective (titanlike/train/dpo.py) flattens that to [2B, S], rows [c0, r0, c1, r1, ...], so a pair is never split
between data-parallel ranks or micro-batches.

Chat-message pairs (a prompt as a list of {role, content} messages, replies as strings or assistant messages) render
through the run's chat template (data.chat_template, else the tokenizer's own), as SFT data does (`_chat_pair`).

Tokenised once at start-up (every rank reads the whole file, as the sample count and fingerprint need). A sequence
longer than seq_len + 1 tokens keeps its start (TRL's truncation_mode="keep_start": the response is cut at the end);
the truncations are counted and logged. A pair whose prompt leaves no response token in the window is dropped
(counted, warned). A pair whose chosen and rejected texts are equal carries no preference: refused at build, naming
its lines.

data.preference_layout = "pack" serves rows instead, each holding several whole pairs end to end
(titanlike/data/preference_pack.py): sample i is row i, `(input_ids [S], labels [S])`, and the loader stacks B rows
to [B, S]. There a pair must fit one row, chosen and rejected together, and the same keep-start rule cuts it to fit.
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
from titanlike.config.validate_dpo import PREFERENCE_LAYOUTS
from titanlike.data.preference_pack import PackedPairs, eod_inside

logger = logging.getLogger(__name__)
FIELDS = ("prompt", "chosen", "rejected")
LAYOUTS = PREFERENCE_LAYOUTS  # data.preference_layout


def _open(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def _chat_pair(row: dict, where: str, template, tokenizer) -> tuple[list[int], list[list[int]]]:
    """A chat-message pair: "prompt" a string (one user turn) or a list of {role, content} messages, "chosen" and
    "rejected" a string (one assistant reply) or a list of messages. Both sides render through the run's chat
    template (titanlike/data/chat.py), as SFT data does; the prompt is what the template renders for the prompt
    messages with the generation prompt, and each side ends at its last assistant token (the end-of-turn token
    included). Returns (prompt ids, [chosen ids, rejected ids])."""
    from titanlike.data.chat import normalize_messages, render_with_masks

    def messages(value, role):
        return [{"role": role, "content": value}] if isinstance(value, str) else normalize_messages(value)

    prompt = messages(row["prompt"], "user")
    p_ids, _ = render_with_masks(template, prompt, tokenizer, add_generation_prompt=True)
    sides = []
    for name in ("chosen", "rejected"):
        ids, mask = render_with_masks(template, prompt + messages(row[name], "assistant"), tokenizer)
        if ids[:len(p_ids)] != p_ids or not any(mask[len(p_ids):]):
            raise ValueError(f"{where}: the chat template does not render the prompt (with its generation prompt) as "
                             f"the start of prompt + {name!r} with an assistant reply after it; give plain strings "
                             f"or a template that appends turns (data.chat_template)")
        sides.append(ids[:max(i for i, m in enumerate(mask) if m) + 1])
    return p_ids, sides


class PreferenceDataset(Dataset):
    def __init__(self, files: list[str], tokenizer, seq_len: int, *, add_bos: bool = False, key: str = "data.paths",
                 dp_rank: int = 0, chat_template=None, layout: str = "pad"):
        """chat_template: a ChatTemplate, or a function returning one (called at the first chat-message row).
        layout: "pad" (a sample is a pair) or "pack" (a sample is a row of pairs)."""
        if layout not in LAYOUTS:
            raise ValueError(f"data.preference_layout={layout!r} is not one of {', '.join(LAYOUTS)}")
        self.files, self.seq_len, self.layout = list(files), int(seq_len), layout
        self.pad_id = tokenizer.eos_id  # never a target: padding has IGNORE_INDEX labels
        window = self.seq_len + 1  # S inputs + the last label
        ident = f"preference|{tokenizer.fingerprint}|{self.seq_len}|{add_bos}"
        if layout == "pack":  # (the padded layout's identity stays what it was: its checkpoints still resume)
            ident += f"|pack|{tokenizer.eod_id}"
        digest = hashlib.sha256(ident.encode())
        self.sides: list[tuple[np.ndarray, int]] = []  # 2 per pair: (tokens, prompt length), chosen then rejected
        self.long: list[bool] = []  # per side: cut to the window
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
                    row = _read_row(line, where)
                    if row["chosen"] == row["rejected"]:
                        identical.append(f"{path}:{n}")
                        continue
                    if all(isinstance(row[k], str) for k in FIELDS):
                        p = tokenizer.encode(row["prompt"], bos=add_bos)
                        sides = [p + tokenizer.encode(row[k], eos=True) for k in ("chosen", "rejected")]
                    else:  # chat messages: through the run's chat template (loaded at the first such row)
                        if callable(chat_template):
                            chat_template = chat_template()
                        p, sides = _chat_pair(row, where, chat_template, tokenizer)
                    sides = [np.asarray(side, dtype=np.int64) for side in sides]
                    if len(p) >= window:  # no response token left in the window: nothing to prefer
                        dropped.append(f"{path}:{n}")
                        continue
                    cut += sum(len(s) > window for s in sides)
                    self.long += [len(s) > window for s in sides]
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
        self.packed = None
        if layout == "pack":
            self._pack(tokenizer.eod_id, key, dp_rank)
        elif cut:
            logger.info(f"preference data: {cut} of {2 * self.num_pairs} sequences cut to training.seq_len + 1 = "
                        f"{window} tokens (their responses end early)")
        if dropped and dp_rank == 0:
            logger.warning(f"preference data: {len(dropped)} pair(s) dropped, their prompt fills the "
                           f"training.seq_len={self.seq_len} window ({', '.join(dropped[:3])}"
                           f"{', ...' if len(dropped) > 3 else ''}); raise training.seq_len to keep them")

    def _pack(self, eod_id: int, key: str, dp_rank: int) -> None:
        """Rows of whole pairs (titanlike/data/preference_pack.py); logs the fill and what was cut or dropped."""
        inside = eod_inside(self.sides, eod_id)
        if inside:
            raise ValueError(f"data.preference_layout='pack' separates sequences at the end-of-document token (id "
                             f"{eod_id}), and {inside} sequences of {key} hold it before their end (e.g. a BOS equal "
                             f"to it with data.add_bos): set data.eod_token to a token the pairs do not use, or use "
                             f"data.preference_layout='pad'")
        self.packed = packed = PackedPairs(self.sides, self.seq_len, eod_id, self.long)
        self.num_pairs, self.truncated = packed.num_pairs, packed.truncated
        self.dropped += len(packed.dropped)
        if packed.num_pairs == 0:
            raise ValueError(f"{key}: no pair fits a row of training.seq_len + 1 = {self.seq_len + 1} tokens with a "
                             f"response token on both sides; raise training.seq_len")
        width = self.seq_len + 1
        if packed.truncated:
            logger.info(f"preference data: {packed.truncated} of {2 * packed.num_pairs} sequences cut so that each "
                        f"pair fits a row of {width} tokens (their responses end early)")
        if packed.dropped and dp_rank == 0:
            logger.warning(f"preference data: {len(packed.dropped)} pair(s) dropped, their prompts leave no room for "
                           f"both responses in a row of {width} tokens; raise training.seq_len to keep them")
        logger.info(f"preference data: {packed.num_pairs:,} pairs in {len(packed):,} rows of {width} (pack: "
                    f"{packed.fill():.0%} filled, {packed.num_pairs / len(packed):.2f} pairs per row on average, at "
                    f"most {packed.max_pairs_per_row()})")

    def __len__(self) -> int:
        """Samples: pairs ("pad"), rows of pairs ("pack")."""
        return len(self.packed) if self.packed is not None else self.num_pairs

    def pairs_per_sample(self) -> float:
        return self.num_pairs / len(self)

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
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        if self.packed is not None:
            return self.packed.row(int(i))
        (ci, cl), (ri, rl) = self.side(2 * i), self.side(2 * i + 1)
        return torch.stack([ci, ri]), torch.stack([cl, rl])

    def sources(self) -> list[list]:
        """[file, content id] per file (titanlike/data/loader_state.py: a resume on other pairs is refused)."""
        return [[f, d] for f, d in zip(self.files, self.file_digests)]

    def summary_lines(self, label: str, samples: int | None, whose: str) -> list[str]:
        if self.packed is not None:
            tokens, unit = self.packed.tokens, "rows"
            layout = f" in {len(self):,} rows (pack, {self.packed.fill():.0%} filled)"
        else:
            tokens, unit, layout = sum(len(t) for t, _ in self.sides), "pairs", ""
        epochs = f", {samples / len(self):,.2f} epochs for {whose} {samples:,} {unit}" if samples else ""
        return [f"{label}: preference pairs, {self.num_pairs:,} pairs from {len(self.files)} file(s){layout}, "
                f"{tokens:,} tokens (prompt + response, both sides), {self.truncated:,} sequences truncated, "
                f"{self.dropped:,} pairs dropped{epochs}"]


def _read_row(line: str, where: str):
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON object ({e.msg}); each line must be {{\"prompt\": ..., \"chosen\": ..., "
                         f"\"rejected\": ...}}") from None
    if not isinstance(row, dict) or any(k not in row for k in FIELDS):
        have = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{where}: each line needs the fields \"prompt\", \"chosen\" and \"rejected\" (found {have})")
    if not all(isinstance(row[k], (str, list)) for k in FIELDS):
        raise ValueError(f"{where}: \"prompt\", \"chosen\" and \"rejected\" must be strings or lists of "
                         f"{{\"role\", \"content\"}} messages")
    return row


def build_preference_dataset(data_cfg, tokenizer, *, seq_len: int, split: str, paths_key: str = "data.paths",
                             dp_rank: int = 0) -> PreferenceDataset:
    from titanlike.data.streaming import expand_files

    if tokenizer is None:
        raise ValueError("data.dataset='preference' tokenises the pairs and needs a tokenizer")
    if split != "train" and paths_key == "data.paths":  # (validate refuses this config before it gets here)
        raise ValueError("validation of preference data needs validation.paths (JSONL files of held-out pairs): the "
                         "pairs files have no split")
    from titanlike.data.chat import load_chat_template

    # Chat-message pairs render through data.chat_template (or the tokenizer's own): loaded at the first such row, or
    # now when named explicitly (a bad name fails before any pair is read).
    template = (load_chat_template(data_cfg, tokenizer) if data_cfg.chat_template
                else (lambda: load_chat_template(data_cfg, tokenizer)))
    return PreferenceDataset(expand_files(data_cfg.paths, key=paths_key), tokenizer, seq_len,
                             add_bos=data_cfg.add_bos, key=paths_key, dp_rank=dp_rank, chat_template=template,
                             layout=data_cfg.preference_layout)
