"""Inference on what titanlike trained (or Hugging Face published): loading and generation with the cache its family
declares (ModelSpec.cache; attention K/V by default).

    load.py      load_for_inference(source, device=, dtype=, step=) -> Loaded(model, spec, args, tokenizer, ...)
    generate.py  generate(model, prompts, max_new_tokens=, ..., pixels=) -> the new tokens of each prompt
    images.py    image files -> an image-text model's pixels; placeholders expanded (scripts/generate.py --image)
"""
from titanlike.infer.generate import generate
from titanlike.infer.load import Loaded, load_for_inference

__all__ = ["Loaded", "generate", "load_for_inference"]
