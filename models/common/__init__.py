"""Building blocks shared by the decoder models: the decoder skeleton (decoder.py), norms, RoPE, attention (core, kernel
choice, FA4 ops), SwiGLU, mixture of experts, and what the Hugging Face adapters share (hf_utils.py).

Nothing under models/ imports the distributed package or titanlike: parallelism is applied from outside (parallelize/).
"""
