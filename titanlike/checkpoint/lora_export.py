"""A LoRA run's steps out of titanlike (docs/post_training.md#lora): merged into the base for an HF export, or as a
PEFT adapter (adapter_config.json + adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads onto the
HF base model.

A LoRA step's meta.json has a "lora" entry (titanlike/train/construct.py: lora_checkpointing): rank, alpha, dropout,
the adapted modules' FQNs, whether the step holds the adapters only, and the base's checkpoint (the run's
checkpoint.initial_load_path). `ModelReader` reads a step's model tensors for the export, merged (W + alpha/rank *
B @ A) when it is a LoRA step, the base's tensors from the base checkpoint when the step holds adapters only.

PEFT's names come from the family's HF adapter (ModelSpec.hf.to_hf), which may also permute rows or columns (the
RoPE rows of query and key projections, where the two RoPE layouts differ). Such a permutation moves B's rows and
A's columns: each adapted weight's mapping is found by sending index tensors through to_hf (row and column numbers,
exact in fp32 below 2^24), and must be a gather of rows and columns (or their transpose: a Conv1D-style HF weight,
PEFT's fan_in_fan_out). A family whose to_hf fuses several weights into one HF tensor (or splits one) has no PEFT
form here: CheckpointError says so.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from titanlike.checkpoint.layout import CheckpointError
from titanlike.checkpoint.resolve import check_output_folder, resolve_step
from titanlike.checkpoint.states import MODEL, full_model_state, read_metadata, tensor_shapes

A, B = ".lora_A.weight", ".lora_B.weight"


def _is_adapter(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


class ModelReader:
    """The model tensors an export writes, from one step (or, for an adapter-only LoRA step, with its base): `shapes`
    {fqn: shape} of the plain model, `read(keys, dtype)` full CPU tensors of those keys, adapters merged (a LoraLinear's
    weight, and the routed experts' stacked weights, expert by expert: models/common/lora.py's key rule)."""

    def __init__(self, step: str, meta: dict, base: str | None = None):
        from models.common.lora import adapted_weights

        self.step, self.lora = step, meta.get("lora")
        step_shapes = tensor_shapes(read_metadata(step), MODEL)
        self.base_path = None
        if self.lora is None:
            self.shapes = step_shapes
            return
        modules = set(self.lora["modules"])
        # {adapted weight: (A key, B key)} of the modules meta.json names
        self.adapted = {w: ab for w, ab in adapted_weights(step_shapes).items() if w.rpartition(".")[0] in modules}
        missing = sorted(modules - {w.rpartition(".")[0] for w in self.adapted})
        if missing:
            raise CheckpointError(f"{step}: meta.json names LoRA modules whose adapters the step lacks ({missing[0]}"
                                  f"{' ...' if len(missing) > 1 else ''}); the step is not a LoRA run's")
        if any(w not in step_shapes for w in self.adapted) or base:  # adapters only (or another base)
            base = base or self.lora.get("base")
            if not base:
                raise CheckpointError(f"{step} holds LoRA adapters only and its run had no "
                                      f"checkpoint.initial_load_path to take the base from: give the base checkpoint "
                                      f"(--base PATH)")
            self.base_path = resolve_step(base, checksums=True).path
        base_shapes = tensor_shapes(read_metadata(self.base_path), MODEL) if self.base_path else step_shapes
        self.shapes = {k: v for k, v in base_shapes.items() if not _is_adapter(k)}
        self.scaling = self.lora["alpha"] / self.lora["rank"]

    def read(self, keys: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        if self.lora is None:
            return full_model_state(self.step, keys=keys, dtype=dtype)
        base = full_model_state(self.base_path or self.step, keys=keys)
        merged = [k for k in keys if k in self.adapted]
        adapters = full_model_state(self.step, keys=[x for k in merged for x in self.adapted[k]]) if merged else {}
        for k in merged:
            a, b = self.adapted[k]
            w = base[k]
            delta = adapters[b].float() @ adapters[a].float()  # batched over the experts of a stacked weight
            base[k] = (w.float() + delta * self.scaling).to(w.dtype)
        return {k: v.to(dtype) for k, v in base.items()}


def _gather(fqn: str, shape: tuple[int, int], to_hf) -> tuple[str, torch.Tensor, torch.Tensor, bool]:
    """(HF weight key, rows, cols, transposed) of the adapted weight `fqn`: the HF module's outputs are W's rows
    `rows`, its inputs W's columns `cols` (its tensor W[rows][:, cols], or that transposed); CheckpointError when to_hf
    does more than gather rows and columns."""
    out, inp = shape
    if max(out, inp) >= 2 ** 24:
        raise CheckpointError(f"PEFT export: {fqn} has {shape}: too large for the exact fp32 index probe")
    rows = torch.arange(out, dtype=torch.float32)[:, None].expand(out, inp).contiguous()
    cols = torch.arange(inp, dtype=torch.float32)[None, :].expand(out, inp).contiguous()
    try:
        hr, hc = to_hf({f"{fqn}.weight": rows}), to_hf({f"{fqn}.weight": cols})
    except (KeyError, ValueError) as e:  # e.g. a weight HF fuses with others (GPT-2's c_attn holds q, k and v)
        raise CheckpointError(f"PEFT export: the family's HF adapter cannot map {fqn}.weight alone ({e}): PEFT "
                              f"cannot hold this adapter; leave it out of lora.target_modules, or export merged "
                              f"weights instead (export)") from None
    if len(hr) != 1 or not next(iter(hr)).endswith(".weight"):
        raise CheckpointError(f"PEFT export: the family's HF adapter maps {fqn}.weight to {sorted(hr)}, not to one "
                              f"HF weight: PEFT cannot hold this adapter; export merged weights instead (export)")
    key = next(iter(hr))
    r, c = hr[key], hc[key]
    if r.ndim == 2 and (r == r[:, :1]).all() and (c == c[:1, :]).all() and r.shape == (out, inp):
        return key, r[:, 0].long(), c[0].long(), False
    if r.ndim == 2 and (r == r[:1, :]).all() and (c == c[:, :1]).all() and r.shape == (inp, out):
        return key, r[0].long(), c[:, 0].long(), True
    raise CheckpointError(f"PEFT export: the family's HF adapter does not map {fqn}.weight by whole rows and columns "
                          f"(it reshapes or mixes them): PEFT cannot hold this adapter; export merged weights instead")


def export_peft(ckpt_path: str, out_dir: str, base_model: str = "", dtype: str = "float32") -> str:
    """A LoRA run's step -> a PEFT adapter folder for the HF export of its base (`base_model`: what
    adapter_config.json's base_model_name_or_path names, a hub id or a folder). Returns out_dir."""
    from safetensors.torch import save_file

    import models
    from titanlike.checkpoint.states import model_from_meta, read_meta_json

    info = resolve_step(ckpt_path, checksums=True)
    meta = read_meta_json(info.path)
    if not meta.get("model_name"):
        raise CheckpointError(f"{info.path}/meta.json is missing: cannot tell the model's shape")
    spec = models.get_spec(meta["model_name"])
    lora = meta.get("lora")
    if not lora:
        raise CheckpointError(f"{info.path} is not a LoRA run's step (its meta.json has no \"lora\" entry): train "
                              f"with lora.enable, or export the whole model with `export`")
    if spec.hf is None:
        raise CheckpointError(f"model {spec.name!r} has no HF adapter (models/{spec.name}/hf.py): no PEFT export")
    check_output_folder(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not empty; nothing is overwritten: choose another folder")
    model, args = model_from_meta(info.path)
    experts = [m for m in lora["modules"] if not isinstance(model.get_submodule(m), torch.nn.Linear)]
    if experts:  # PEFT holds LoRA per Linear; HF's experts are per-expert Linears or fused 3-D parameters by version
        raise CheckpointError(f"PEFT export: {info.path} has adapters on routed experts ({experts[0]}), which this "
                              f"export does not map to PEFT's modules: export merged weights instead (export)")
    keys = [f"{m}{s}" for m in lora["modules"] for s in (A, B)]
    adapters = full_model_state(info.path, keys=keys, dtype=getattr(torch, dtype))
    tensors, modules, fan_in_fan_out = {}, {}, set()

    def to_hf(sd):
        return spec.hf.to_hf(sd, args)

    for m in lora["modules"]:
        a, b = adapters[m + A], adapters[m + B]
        key, rows, cols, transposed = _gather(m, (b.shape[0], a.shape[1]), to_hf)
        module = key[:-len(".weight")]
        fan_in_fan_out.add(transposed)  # (PEFT's A stays [r, in] and B [out, r] either way)
        tensors[f"base_model.model.{module}.lora_A.weight"] = a[:, cols].contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b[rows].contiguous()
        modules[m] = module
    if len(fan_in_fan_out) > 1:
        raise CheckpointError("PEFT export: some adapted HF modules store their weights transposed and some not; "
                              "one adapter_config.json cannot say both (fan_in_fan_out)")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
              "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
              "target_modules": _targets(model, modules, to_hf), "bias": "none", "fan_in_fan_out": fan_in_fan_out.pop(),
              "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "modules_to_save": None}
    tmp = out_dir.rstrip("/") + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    if os.path.exists(out_dir):
        os.rmdir(out_dir)  # empty (checked above)
    os.rename(tmp, out_dir)
    return out_dir


def _targets(model, modules: dict[str, str], to_hf) -> list[str]:
    """adapter_config.json's target_modules: HF's short names (q_proj, ...) when the HF modules of those names are
    exactly the adapted ones (PEFT matches a short name anywhere), else the adapted HF modules' full names. The HF name
    of every Linear of the model comes from to_hf on a meta tensor of its weight's shape."""
    from models.common.lora import candidates

    adapted = set(modules.values())
    names = {m.rsplit(".", 1)[-1] for m in adapted}
    every = set()
    for fqn, lin in candidates(model, include_experts=True)[0].items():
        try:
            hf = to_hf({f"{fqn}.weight": torch.empty(lin.out_features, lin.in_features, device="meta")})
        except (KeyError, ValueError):  # a weight HF fuses with others: not an HF module of its own
            continue
        every.update(k[:-len(".weight")] for k in hf if k.endswith(".weight"))
    if {m for m in every if m.rsplit(".", 1)[-1] in names} == adapted:
        return sorted(names)
    return sorted(adapted)


__all__ = ["ModelReader", "export_peft"]
