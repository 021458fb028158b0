"""T5 model arguments (named sizes in flavors.py; run knobs live in configs/)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelArgs:
    dim: int = 512  # d_model
    n_layers: int = 8  # encoder blocks (HF's num_layers); model.n_layers overrides it, the decoder keeps its own
    n_decoder_layers: int = 8  # HF's num_decoder_layers
    n_heads: int = 6
    head_dim: int = 64  # HF's d_kv: T5 does not tie it to dim / n_heads (t5-3b: 1024 wide, 32 heads of 128)
    ffn_dim: int = 1024  # HF's d_ff
    vocab_size: int = 32128  # the trainer sets it from the tokenizer (or model.vocab_size)
    max_seq_len: int = 512  # encoder tokens of a training row; the trainer sets it to training.seq_len
    # Longest decoder input the forward accepts (0: max_seq_len). Relative positions need no table, but a limit keeps
    # a run from silently training on decoder lengths the objective never makes.
    max_decoder_len: int = 0
    # v1.1 (True): gated-GELU FFN (gelu_new of w1 times w3), untied LM head. The original T5 (False): ReLU FFN, the
    # LM head tied to the word table with the decoder output scaled by dim ** -0.5 first.
    gated: bool = True
    tie_embeddings: bool = False
    # Megatron-Core's T5Model (models/t5/megatron.py imports it; flavor debugmodel_megatron) is a BERT-style
    # encoder-decoder; each field below switches one of its differences on, the defaults are T5's (HF parity).
    position_embedding: str = "relative"  # "learned": one absolute table of max_position_rows, added in both stacks
    max_position_rows: int = 0  # the learned table's rows (0: max_seq_len); Megatron's --max-position-embeddings
    norm: str = "rms"  # "layernorm": LayerNorm with a bias (Megatron) instead of T5's RMS norm
    linear_bias: bool = False  # biases on every attention and FFN linear (Megatron's --add-bias-linear)
    activation: str = "relu"  # the ungated FFN's: "relu" (the original T5) or "gelu" (Megatron)
    gelu_approximate: str = "tanh"  # either GELU's: "tanh" (gelu_new; Megatron's fused bias-GELU) or "none"
    attn_scale: bool = False  # True: logits scaled by head_dim ** -0.5 (Megatron); T5 folds it into the q init
    output_bias: bool = False  # the head's own bias (Megatron's tied output_layer.bias)
    tied_scale: bool = True  # a tied head reads the decoder output scaled by dim ** -0.5 (T5); Megatron does not
    rel_buckets: int = 32  # relative position buckets, one table per stack shared by its blocks
    rel_max_distance: int = 128  # distances beyond this share the last (log-spaced) bucket
    norm_eps: float = 1e-6
    init_factor: float = 1.0  # HF's initializer_factor
    # Span corruption (models/t5/objective.py): the share of a row's tokens that become targets, the mean length of
    # a masked span, and the sentinel ids: span i gets sentinel_top - i (T5's <extra_id_i>; negative: counted from
    # the end of the vocabulary), at most n_sentinels of them.
    noise_density: float = 0.15
    mean_span_length: float = 3.0
    sentinel_top: int = -1
    n_sentinels: int = 100
    decoder_multiple: int = 8  # the objective pads the decoder to a multiple of this (sequence parallel cuts it)
    pad_token_id: int = 0  # encoder padding and the decoder's start token, as T5's

    def __post_init__(self) -> None:
        if self.tie_embeddings and self.gated:
            # Not a T5 that exists; HF would load it, but refuse rather than guess which scale the user meant.
            raise ValueError("tie_embeddings=True with gated=True: v1.1 unties the LM head; set tie_embeddings=false "
                             "(or gated=false for the original T5)")
        for name, value, allowed in (("position_embedding", self.position_embedding, ("relative", "learned")),
                                     ("norm", self.norm, ("rms", "layernorm")),
                                     ("activation", self.activation, ("relu", "gelu")),
                                     ("gelu_approximate", self.gelu_approximate, ("tanh", "none"))):
            if value not in allowed:
                raise ValueError(f"model.args.{name}={value!r}: choose one of {list(allowed)}")

    @property
    def is_hf_t5(self) -> bool:
        """Whether these are one of HF's T5 variants (the HF adapter's and the objective-free defaults)."""
        return (self.position_embedding, self.norm, self.linear_bias, self.activation, self.attn_scale,
                self.output_bias, self.tied_scale) == ("relative", "rms", False, "relu", False, False, True) and \
            self.gelu_approximate == "tanh"

    @property
    def inner_dim(self) -> int:
        """Query (and key, value) width of one attention: n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def hidden_dim(self) -> int:
        return self.ffn_dim

    @property
    def decoder_limit(self) -> int:
        return self.max_decoder_len or self.max_seq_len
