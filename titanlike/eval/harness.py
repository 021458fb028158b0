"""The lm-evaluation-harness model adapter, registered as `titanlike`.

    python scripts/evaluate.py --tasks hellaswag --checkpoint outputs/run/checkpoint     # imports this module
    lm_eval.simple_evaluate(model=TitanlikeLM(model=m, tokenizer=tok, max_length=2048), tasks=[...])

lm_eval 0.4.13 finds models only in its own registry (no entry-point plugins), so `lm_eval --model titanlike` works
only in a process that imported this module; scripts/evaluate.py does that and then calls `lm_eval.simple_evaluate`.

The adapter takes a model directly (the training loop, tests) or loads one from
`--model_args checkpoint=PATH,device=cuda,dtype=bfloat16,batch_size=16[,step=N,max_length=L,max_gen_toks=G,add_bos=B]`
through titanlike.infer.load_for_inference (a run or step folder, an export, a Hugging Face folder). add_bos: texts
start with BOS as the model's training documents did (default: a Hugging Face folder yes, a titanlike checkpoint as
its config.toml's data.add_bos says); without it an empty context is conditioned on the document separator.
Scoring is plain full forwards (scoring.py); generation is titanlike.infer.generate (KV cache, greedy unless the
task asks for sampling).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from titanlike.eval.scoring import TokenScorer


@register_model("titanlike")
class TitanlikeLM(TemplateLM):
    def __init__(self, checkpoint: str | None = None, device: str | None = None, dtype: str = "float32",
                 batch_size: int | str | None = 8, max_length: int | str | None = None, step: int | str | None = None,
                 max_gen_toks: int | str = 256, max_batch_size: int | None = None, add_bos: bool | str | None = None,
                 *, model=None, tokenizer=None,
                 shard: tuple[int, int, object] | None = None, fixed_shape: bool = False,
                 context: Callable[[], contextlib.AbstractContextManager] | None = None, progress: bool = True):
        super().__init__()
        self.stop_ids: list[int] = []  # the checkpoint's EOS ids (and document separator) end a generation
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if model is None:
            if not checkpoint:
                raise ValueError("the titanlike model needs a checkpoint: --model_args checkpoint=PATH (a run, step, "
                                 "export or Hugging Face folder)")
            from titanlike.infer.load import load_for_inference

            if not hasattr(torch, str(dtype)) or not isinstance(getattr(torch, str(dtype)), torch.dtype):
                raise ValueError(f"dtype={dtype!r}: one of float32, bfloat16, float16")
            loaded = load_for_inference(str(checkpoint), device=device, dtype=getattr(torch, str(dtype)),
                                        step=int(step) if step not in (None, "") else None)
            model, tokenizer = loaded.model, loaded.tokenizer
            self.stop_ids = list(loaded.stop_ids)
            if add_bos in (None, ""):
                add_bos = _trained_with_bos(loaded)
            max_length = max_length or loaded.max_seq_len
            if tokenizer is None:
                raise ValueError(f"{checkpoint}: no tokenizer found with the checkpoint; lm_eval tasks are text, so "
                                 f"evaluate a checkpoint whose run used a tokenizer (not data.dataset=mock)")
        if tokenizer is None or not max_length:
            raise ValueError("TitanlikeLM(model=...) also needs tokenizer= and max_length=")
        # "auto" (lm_eval's batch-size search) is not implemented: a fixed size is predictable under FSDP.
        bs = 8 if batch_size in (None, "auto") or str(batch_size).startswith("auto") else int(batch_size)
        self.model, self.tokenizer, self._device = model, tokenizer, torch.device(device)
        self.max_length, self.batch_size, self.max_gen_toks = int(max_length), bs, int(max_gen_toks)
        self.shard, self.context = shard, context or contextlib.nullcontext
        self.add_bos = str(add_bos).lower() in ("true", "1", "yes")
        pad = tokenizer.eod_id if tokenizer.eod_id is not None else 0
        self.scorer = TokenScorer(model, max_len=self.max_length, batch_size=bs, device=self._device, pad_id=pad,
                                  fixed_shape=fixed_shape, shard=shard, context=self.context, progress=progress)

    # -- tokenizer ---------------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id if self.tokenizer.eos_id is not None else self.tokenizer.eod_id

    @property
    def prefix_token_id(self) -> int:
        # What a document starts after in training: BOS when the data added it (data.add_bos, Hugging Face models),
        # else the document separator that packing puts between documents (data.add_eod).
        if self.add_bos and getattr(self.tokenizer, "bos_id", None) is not None:
            return self.tokenizer.bos_id
        return self.tokenizer.eod_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # add_special_tokens=False: lm_eval encodes a continuation on its own (after the prefix token)
        return list(self.tokenizer.encode(string, bos=self.add_bos and add_special_tokens is not False))

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def tokenizer_name(self) -> str:
        return type(self.tokenizer).__name__

    # -- scoring -----------------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self.scorer.score([(ctx, cont) for _, ctx, cont in requests])
        for (key, _, _), res in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-likelihood over disjoint windows of the model's context, every window after the first
        conditioned on the tokens before it (lm_eval's get_rolling_token_windows, as its HF model does); all windows
        of all texts are batched together."""
        windows, owners = [], []
        for n, (text,) in enumerate(req.args for req in requests):
            # (no BOS in the text's tokens: the prefix token before the first window plays that part)
            rolling = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(text, add_special_tokens=False),
                                                         prefix_token=self.prefix_token_id,
                                                         max_seq_len=self.max_length, context_len=1)
            for window in map(lm_utils.make_disjoint_window, rolling):
                windows.append(window)
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (ll, _) in zip(owners, self.scorer.score(windows)):
            totals[n] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation --------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or the task's sampling) continuation of each context until one of `until` or `max_gen_toks`
        tokens, via titanlike.infer.generate. The text is cut at the first `until` string (the token-level stop
        sequences only end generation early: a stop string can tokenize differently inside a continuation).
        Every rank generates every request (generation length is data-dependent; sharding it under FSDP would give
        the ranks different numbers of forwards)."""
        from titanlike.infer.generate import generate

        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # one generate call per distinct set of generation arguments
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for idx in groups.values():
            kw = dict(requests[idx[0]].args[1])
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            eot_text = self.tok_decode([self.eot_token_id])
            if eot_text and eot_text not in until:
                until.append(eot_text)
            max_new = min(int(kw.pop("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
            sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 0.0)) if sample else 0.0
            keep = max(1, self.max_length - max_new)  # the prompt and the new tokens fit the context
            for start in range(0, len(idx), self.batch_size):
                chunk = idx[start:start + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0])[-keep:] for i in chunk]
                stops = [s for s in (self.tok_encode(u, add_special_tokens=False) for u in until) if s]
                with self.context():
                    new = generate(self.model, prompts, max_new_tokens=max_new,
                                   eos_id=self.stop_ids or self.eot_token_id, stop=stops, temperature=temperature,
                                   top_k=int(kw.get("top_k", 0) or 0), top_p=float(kw.get("top_p", 1.0) or 1.0),
                                   seed=0 if sample else None)
                for i, ids in zip(chunk, new):
                    text = self.tok_decode(ids)
                    for u in until:
                        text = text.split(u)[0] if u else text
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]


def _trained_with_bos(loaded) -> bool:
    """Whether the checkpoint's documents started with BOS: a Hugging Face folder's always do (step None); a titanlike
    step folder says so in its config.toml ([data] add_bos)."""
    import os

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    if loaded.step is None:
        return True
    path = os.path.join(loaded.source, "config.toml")
    try:
        with open(path, "rb") as f:
            return bool(tomllib.load(f).get("data", {}).get("add_bos", False))
    except (OSError, ValueError):
        return False

