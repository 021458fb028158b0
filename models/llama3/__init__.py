"""Llama 3 family: model, flavors, counting helpers. The HF adapter lives in models.llama3.hf."""

from models.llama3.args import ModelArgs, llama3_flavors
from models.llama3.counts import count_params, flops_per_token
from models.llama3.model import Attention, FeedForward, Transformer, TransformerBlock

__all__ = [
    "Attention",
    "FeedForward",
    "ModelArgs",
    "Transformer",
    "TransformerBlock",
    "count_params",
    "flops_per_token",
    "llama3_flavors",
]
