"""The post-training peer: what users run today for SFT, LoRA and DPO, TRL's trainers on the transformers model of the
same shape, on the same data and tokenizer as titanlike (scripts/bench/post_training_data.py).

    python scripts/bench/peer_trl.py sft 1B --training.seq_len 4096 --training.local_batch_size 2 --compile.enable
    python scripts/bench/peer_trl.py lora 8B --training.seq_len 4096 --training.local_batch_size 1
    python scripts/bench/peer_trl.py dpo 1B --training.seq_len 2048 --training.local_batch_size 4
    python scripts/bench/peer_trl.py sft debugmodel --device cpu --training.seq_len 256 --training.steps 3  # smoke

MODE is sft | lora | dpo; FLAVOR a flavor of --model (MODEL in the environment, else the default family).
The model: `AutoModelForCausalLM.from_config` of the HF config titanlike's adapter writes for the flavor (the same
shapes, so the same FLOPs per token), vocabulary --vocab (benchmark.py passes the one titanlike gets), random init,
bf16 weights, SDPA attention (no flash-attn on the GPU machine). TRL's settings, the fastest that run there:
- sft / lora: SFTTrainer on `chat.jsonl`, assistant_only_loss (the tokenizer's template marks replies with
  {% generation %}), packing with packing_strategy="bfd": best-fit packing into rows of seq_len, each conversation
  kept whole, padding-free (a step's rows flattened into one [1, T] sequence with position_ids restarting at every
  conversation). That is correct under SDPA too: transformers builds the block-diagonal causal mask from the
  restarting position_ids when no attention_mask is given (masking_utils.find_packed_sequence_indices), so each
  conversation attends only to itself, as titanlike's data.document_masking. ("wrapped" packing would let
  conversations attend to each other, and padding each one to seq_len would waste the step.) lora adds PEFT's
  LoraConfig with titanlike's [lora] defaults (rank, alpha, dropout, target modules mapped to HF's names).
- dpo: DPOTrainer on `pairs.jsonl` (conversational pairs, sigmoid loss, beta 0.1), max_length = seq_len; the
  reference as titanlike's dpo.reference: `precompute` (precompute_ref_log_probs=True: one pass before training, as
  titanlike) or `frozen_copy` (a frozen copy of the initial model, a second forward per step).
- bf16=True, optim adamw_torch_fused, gradient checkpointing only with --activation_checkpoint.mode full,
  torch_compile with --compile.enable (--torch-compile on|off overrides it), no logging/saving/evaluation inside the
  Trainer, constant LR after 2 warm-up steps, grad clip 1.0.

Measured by a TrainerCallback: wall time between the ends of optimizer steps (synchronised at each log line), over
the tokens of those steps. sft/lora: the tokens in the step's packed batch (padding-free: no padding). dpo: 2·B·seq_len
per step (B pairs, two sequences of seq_len each), from which scripts/bench/benchmark.py takes the step time and
compares B pairs per step time with titanlike's logged pairs/s; the tokens TRL actually ran (it pads each batch to
its longest sequence) follow as `real_tps`.
Prints torchtitan-style lines "step: N loss: X memory: Y GiB tps: Z tflops: T mfu: M%" that scripts/bench/benchmark.py
parses (--peer trl-sft | trl-lora | trl-dpo); memory is torch.cuda.max_memory_reserved (the process's peak RSS on
CPU), MFU the model FLOPs (titanlike's spec.flops_per_token: 6·N + attention, also for LoRA) over 989 TFLOP/s.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import resource
import tempfile
import time

import torch

import models  # the repository on PYTHONPATH, as every bench script expects
from peer_flags import add_run_flags  # scripts/bench, beside this script
from post_training_data import ensure

PEAK = 989e12  # dense bf16 FLOP/s of an H100/H200, as titanlike's MFU
MODES = ("sft", "lora", "dpo")


def hf_lora_targets(spec, args, targets: list[str]) -> list[str]:
    """titanlike's lora.target_modules (its own module names) as HF's short module names: every Linear of the
    family's model (built on meta) that a target matches, named through the family's HF adapter (to_hf)."""
    from models.common.lora import candidates, matches

    with torch.device("meta"):
        model = spec.model_cls(args)
    names = set()
    for fqn, lin in candidates(model, include_experts=False)[0].items():
        if any(matches(fqn, t) for t in targets):
            hf = spec.hf.to_hf({f"{fqn}.weight": torch.empty(lin.out_features, lin.in_features, device="meta")}, args)
            names.update(k[:-len(".weight")].rsplit(".", 1)[-1] for k in hf if k.endswith(".weight"))
    if not names:
        raise SystemExit(f"peer_trl: lora targets {targets} match no Linear of {spec.name}")
    return sorted(names)


def build_model(spec, args, seq: int, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(spec.hf.hf_config(args, torch.bfloat16, max_position_embeddings=seq))
    cfg.pop("architectures", None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Meter:
    """Tokens and loss of the steps since the last log line (filled by the trainer's training_step) and the clock."""

    def __init__(self, a, fpt: float, cuda: bool):
        self.a, self.fpt, self.cuda = a, fpt, cuda
        self.tokens = 0  # counted tokens since the last line (int: shapes only, no device sync)
        self.real = []  # dpo: non-padding token counts (device tensors, read at the line)
        self.loss = None
        self.t_last = None
        self.n_since = 0

    def count(self, inputs: dict) -> None:
        if self.t_last is None:  # the first step's window starts when its batch arrives
            self.t_last = time.perf_counter()
        a = self.a
        if a.mode == "dpo":
            self.tokens += 2 * a.batch * a.seq
            self.real.append(inputs["attention_mask"].sum())
        elif "attention_mask" in inputs:
            self.real.append(inputs["attention_mask"].sum())
            self.tokens += inputs["attention_mask"].numel()
        else:  # padding-free: one [1, T] row of real tokens
            self.tokens += inputs["input_ids"].numel()

    def step_end(self, step: int) -> None:
        a = self.a
        self.n_since += 1
        if step % a.log_freq and step != a.steps:
            return
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt = now - self.t_last
        real = int(sum(int(r) for r in self.real))
        tokens = self.tokens if a.mode == "dpo" or not self.real else real
        tps = tokens / dt
        if self.cuda:
            mem = torch.cuda.max_memory_reserved() / 2**30
        else:
            mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        value = float(self.loss) if self.loss is not None else float("nan")
        extra = f" real_tps: {real / dt:,.0f}" if a.mode == "dpo" else ""
        print(f"step: {step} loss: {value if math.isfinite(value) else float('nan'):.4f} memory: {mem:.2f}GiB "
              f"tps: {tps:,.0f} tflops: {tps * self.fpt / 1e12:.2f} mfu: {100 * tps * self.fpt / PEAK:.2f}%{extra}",
              flush=True)
        self.tokens, self.real, self.n_since, self.t_last = 0, [], 0, time.perf_counter()


def timed(base, meter: Meter):
    """`base` (a TRL trainer class) with its training_step reporting each batch and loss to `meter`."""

    class Timed(base):
        def training_step(self, model, inputs, *args, **kwargs):
            meter.count(inputs)
            loss = super().training_step(model, inputs, *args, **kwargs)
            meter.loss = loss.detach()
            return loss

    return Timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=MODES)
    p.add_argument("flavor")
    p.add_argument("--model", default=os.environ.get("MODEL", models.DEFAULT_MODEL))
    p.add_argument("--data", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "titanlike_post"),
                   help="folder of post_training_data.py (written there first when missing)")
    add_run_flags(p, batch=2, steps=20)
    p.add_argument("--torch-compile", choices=("auto", "on", "off"), default="auto",
                   help="TRL's torch_compile: auto follows --compile.enable (benchmark.py: "
                        "--peer-extra='--torch-compile off' runs TRL eager beside a compiled titanlike, where its "
                        "compiled run fails or is slower)")
    p.add_argument("--dpo.reference", dest="reference", choices=("precompute", "frozen_copy"), default="precompute")
    p.add_argument("--vocab", type=int, default=0, help="model vocabulary (0: the tokenizer's size)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a, unknown = p.parse_known_args()
    if unknown:
        print(f"peer_trl: ignoring {unknown}", flush=True)
    compile_ = a.compile if a.torch_compile == "auto" else a.torch_compile == "on"
    # Everything is local; the GPU machine has no network, where a hub lookup would only wait for its timeout.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import peft
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from titanlike.config.sections import Lora

    ensure(a.data)
    tok = AutoTokenizer.from_pretrained(os.path.join(a.data, "tokenizer"))
    spec = models.get_spec(a.model)
    flavor = spec.flavors[a.flavor]
    args = dataclasses.replace(flavor, vocab_size=a.vocab or len(tok), max_seq_len=a.seq)
    cuda = a.device == "cuda"
    model = build_model(spec, args, a.seq, a.device)
    fpt = spec.flops_per_token(args, a.seq)
    meter = Meter(a, fpt, cuda)

    class Clock(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            meter.step_end(state.global_step)

    cores = os.cpu_count() or 1
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="peer_trl_"), max_steps=a.steps, per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=1, learning_rate=a.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=2,
        weight_decay=0.1, max_grad_norm=1.0, optim="adamw_torch_fused" if cuda else "adamw_torch", bf16=True,
        gradient_checkpointing=a.ac == "full", torch_compile=compile_, logging_strategy="no", save_strategy="no",
        eval_strategy="no", report_to="none", disable_tqdm=True, seed=0, data_seed=0, use_cpu=not cuda,
        dataloader_pin_memory=cuda, max_length=a.seq, dataset_num_proc=min(8, cores // 2) if cores >= 4 else None)
    line = f"peer_trl: {a.mode} {a.model} {a.flavor} seq {a.seq} batch {a.batch}, torch_compile {compile_}, trl " \
           f"{trl.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, torch " \
           f"{torch.__version__}"
    if a.mode in ("sft", "lora"):
        from transformers import masking_utils
        from trl import SFTConfig, SFTTrainer

        if not hasattr(masking_utils, "find_packed_sequence_indices"):  # else SDPA would attend across conversations
            raise SystemExit(f"peer_trl: transformers {transformers.__version__} does not mask packed sequences "
                             "by their position ids under SDPA: padding-free packing would be wrong")

        config = SFTConfig(**common, packing=True, packing_strategy="bfd", assistant_only_loss=True)
        peft_config = None
        if a.mode == "lora":
            lora = Lora()
            peft_config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                          target_modules=hf_lora_targets(spec, args, lora.target_modules),
                                          bias="none", task_type="CAUSAL_LM")
            line += f", LoRA r={lora.rank} alpha={lora.alpha} on {sorted(peft_config.target_modules)}"
        data = Dataset.from_list(_rows(os.path.join(a.data, "chat.jsonl")))
        trainer = timed(SFTTrainer, meter)(model=model, args=config, train_dataset=data, processing_class=tok,
                                           peft_config=peft_config, callbacks=[Clock()])
    else:
        from trl import DPOConfig, DPOTrainer

        pre = a.reference == "precompute"
        config = DPOConfig(**common, beta=0.1, loss_type=["sigmoid"], precompute_ref_log_probs=pre)
        # A model built from a config has no path TRL could load a reference from: the frozen copy is handed in.
        ref = None if pre else copy.deepcopy(model).eval().requires_grad_(False)
        data = Dataset.from_list(_rows(os.path.join(a.data, "pairs.jsonl")))
        trainer = timed(DPOTrainer, meter)(model=model, ref_model=ref, args=config, train_dataset=data,
                                           processing_class=tok, callbacks=[Clock()])
        line += f", reference {a.reference}"
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print(f"{line}; {trainable:,} trainable parameters; {fpt / 1e9:.2f} GFLOP/token", flush=True)
    trainer.train()


if __name__ == "__main__":
    main()
