"""State-dict adapter between titanlike T5 and transformers' T5ForConditionalGeneration (v1.1: gated-gelu, untied
lm_head; the original: relu, lm_head tied to `shared`). Pure tensor/dict code (no `transformers` import).

HF keeps each stack's relative-position table in its block 0 (`...block.0.layer.0.SelfAttention.
relative_attention_bias`); here it is one top-level table per stack. `encoder.embed_tokens` / `decoder.embed_tokens`
(and a tied `lm_head`) are `shared`: export writes `shared` only, import skips the aliases.
"""
from __future__ import annotations

import re

import torch

from models.t5.args import ModelArgs

ARCHITECTURES = ("T5ForConditionalGeneration",)
MODEL_TYPES = ("t5",)
AUTO_CLASS = "AutoModelForSeq2SeqLM"  # transformers' auto class for these architectures (the contract test's)

_TOP = {
    "tok_embeddings.weight": "shared.weight",
    "encoder_rel_bias.weight": "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    "decoder_rel_bias.weight": "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    "encoder_norm.weight": "encoder.final_layer_norm.weight",
    "decoder_norm.weight": "decoder.final_layer_norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTN = {"wq": "q", "wk": "k", "wv": "v", "wo": "o"}
_FFN = {"w1": "wi_0", "w3": "wi_1", "w2": "wo"}  # gated; ReLU: w1 -> wi
# per stack: titanlike block module -> (HF sub-layer index, HF module)
_ENC = {"attention": (0, "SelfAttention"), "attention_norm": (0, "layer_norm"), "feed_forward": (1, "DenseReluDense"),
        "ffn_norm": (1, "layer_norm")}
_DEC = {"attention": (0, "SelfAttention"), "attention_norm": (0, "layer_norm"),
        "cross_attention": (1, "EncDecAttention"), "cross_norm": (1, "layer_norm"),
        "feed_forward": (2, "DenseReluDense"), "ffn_norm": (2, "layer_norm")}
_TL_RE = re.compile(r"^(encoder|decoder)_layers\.(\d+)\.(\w+)\.(?:(\w+)\.)?weight$")
_HF_RE = re.compile(r"^(encoder|decoder)\.block\.(\d+)\.layer\.(\d)\.(\w+)\.(?:(\w+)\.)?weight$")
_HF_SKIP = re.compile(r"^(encoder|decoder)\.embed_tokens\.weight$")


def _ffn(args: ModelArgs) -> dict[str, str]:
    return _FFN if args.gated else {"w1": "wi", "w2": "wo"}


def supports(args: ModelArgs) -> bool:
    """Whether transformers' T5 can hold a model of these args (not Megatron's variant); the contract tests ask."""
    return args.is_hf_t5


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """titanlike FQNs -> HF FQNs (whole tensors; a partial dict, one export shard, works)."""
    if not args.is_hf_t5:  # learned positions, LayerNorm, biases, ...: transformers' T5 has no place for them
        raise ValueError("to_hf: this T5 has Megatron-Core's T5Model switches (model.args.position_embedding, norm, "
                         "linear_bias, ...), which transformers' T5ForConditionalGeneration cannot hold: no HF export")
    out: dict[str, torch.Tensor] = {}
    ffn = _ffn(args)
    for key, value in state_dict.items():
        if key == "output.weight" and args.tie_embeddings:
            continue  # lm_head is `shared`
        if key in _TOP:
            out[_TOP[key]] = value
            continue
        m = _TL_RE.match(key)
        table = (_ENC if m and m.group(1) == "encoder" else _DEC) if m else {}
        if m is None or m.group(3) not in table:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
        stack, i, module, leaf = m.groups()
        sub, hf_module = table[module]
        names = _ATTN if "attention" in module and leaf else ffn if leaf else {}
        if leaf is not None and leaf not in names:
            raise KeyError(f"to_hf: unexpected titanlike key {key!r}")
        hf_leaf = f"{names[leaf]}." if leaf else ""
        out[f"{stack}.block.{i}.layer.{sub}.{hf_module}.{hf_leaf}weight"] = value
    return out


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF FQNs -> titanlike FQNs; with a tied head output.weight is the word table (the same tensor)."""
    top = {v: k for k, v in _TOP.items()}
    ffn_inv = {v: k for k, v in _ffn(args).items()}
    attn_inv = {v: k for k, v in _ATTN.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in hf_state_dict.items():
        if _HF_SKIP.match(key) or (key == "lm_head.weight" and args.tie_embeddings):
            continue
        if key in top:
            out[top[key]] = value
            continue
        m = _HF_RE.match(key)
        if m is None:
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
        stack, i, sub, hf_module, leaf = m.groups()
        table = _ENC if stack == "encoder" else _DEC
        module = next((k for k, v in table.items() if v == (int(sub), hf_module)), None)
        names = attn_inv if hf_module.endswith("Attention") else ffn_inv
        if module is None or (leaf is not None and leaf not in names):
            raise KeyError(f"from_hf: unexpected HF key {key!r}")
        out[f"{stack}_layers.{i}.{module}.{names[leaf] + '.' if leaf else ''}weight"] = value
    if args.tie_embeddings and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def args_from_hf_config(config: dict) -> ModelArgs:
    """ModelArgs from a T5Config dict (config.json)."""
    proj = config.get("feed_forward_proj", "relu")
    if proj not in ("relu", "gated-gelu"):
        raise ValueError(f"T5 config feed_forward_proj={proj!r}: titanlike T5 builds 'relu' (the original) and "
                         f"'gated-gelu' (v1.1)")
    gated = proj == "gated-gelu"
    tied = config.get("tie_word_embeddings", True)
    if gated and tied:
        raise ValueError("T5 config with feed_forward_proj='gated-gelu' and tie_word_embeddings=true: titanlike "
                         "builds v1.1 untied and the original (relu) tied")
    layers = config.get("num_layers", 6)
    vocab = config.get("vocab_size", 32128)
    return ModelArgs(
        dim=config.get("d_model", 512), n_layers=layers, n_decoder_layers=config.get("num_decoder_layers") or layers,
        n_heads=config.get("num_heads", 8), head_dim=config.get("d_kv", 64), ffn_dim=config.get("d_ff", 2048),
        vocab_size=vocab, gated=gated, tie_embeddings=tied,
        rel_buckets=config.get("relative_attention_num_buckets", 32),
        rel_max_distance=config.get("relative_attention_max_distance", 128),
        norm_eps=config.get("layer_norm_epsilon", 1e-6), init_factor=config.get("initializer_factor", 1.0),
        pad_token_id=config.get("pad_token_id", 0),
        sentinel_top=32099 if vocab == 32128 else -1,  # the published tokenizer's <extra_id_0>
    )


def hf_config(args: ModelArgs, dtype: torch.dtype, max_position_embeddings: int | None = None) -> dict:
    """A transformers T5Config dict (relative positions: no position table, so max_position_embeddings is unused)."""
    return {
        "architectures": list(ARCHITECTURES[:1]), "model_type": "t5", "is_encoder_decoder": True,
        "d_model": args.dim, "d_kv": args.head_dim, "d_ff": args.ffn_dim, "num_layers": args.n_layers,
        "num_decoder_layers": args.n_decoder_layers, "num_heads": args.n_heads, "vocab_size": args.vocab_size,
        "relative_attention_num_buckets": args.rel_buckets,
        "relative_attention_max_distance": args.rel_max_distance, "dropout_rate": 0.0,
        "layer_norm_epsilon": args.norm_eps, "initializer_factor": args.init_factor,
        "feed_forward_proj": "gated-gelu" if args.gated else "relu", "tie_word_embeddings": args.tie_embeddings,
        "pad_token_id": args.pad_token_id, "eos_token_id": 1, "decoder_start_token_id": args.pad_token_id,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }


def example_inputs(tokens: torch.Tensor) -> tuple[dict, dict]:
    """For the contract tests: our forward's keyword inputs and transformers' for the same logits, from encoder
    tokens (the decoder reads them shifted right after the start token)."""
    dec = torch.cat([torch.zeros_like(tokens[:, :1]), tokens[:, :-1]], dim=1)
    return {"decoder_tokens": dec}, {"input_ids": tokens, "decoder_input_ids": dec}
