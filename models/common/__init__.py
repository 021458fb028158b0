"""Building blocks shared by the decoder models: norms, RoPE, attention (core, kernel choice, FA4 ops), SwiGLU.

Nothing under models/ imports the distributed package or titanlike: parallelism is applied from outside (parallelize/).
"""
