"""The Linux CPU path: OpenBLAS under MLX's CPU backend and the float32 model layout.

Entered only from the model's load (engine/model/model_load.py) and the engine's start
(fast_blas, chosen before MLX loads); on Metal and CUDA none of it runs. Every file, one line each:

  fast_blas.py            Linux: OpenBLAS under MLX's CPU backend, chosen before MLX loads
  cpu_linear.py           the CPU's float32 path: Linear and Embedding weights held transposed (optionally in blocks on 2 streams)
  cpu_decode.py           the CPU's float32 path: a decoded token in a quarter of the MLX ops (RoPE, RMSNorm, attention, MLP)
"""
