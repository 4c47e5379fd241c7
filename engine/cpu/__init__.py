"""The Linux CPU path: OpenBLAS under MLX's CPU backend, which models load as float32, and their layout.

Entered only from the engine's start (fast_blas, chosen before MLX loads), the model registry's dtype
policy (fast_blas.weights_dtype_on_cpu), the model's load (backend_ops.weights_plan on every backend,
cpu_decode.prepare_float32) and the embedding
model's (cpu_encoder.prepare_encoder); on Metal and
CUDA none of it runs. The layouts kept only to compare are bench/cpu_arms.py's. Every file, one line each:

  fast_blas.py            Linux: OpenBLAS under MLX's CPU backend, chosen before MLX loads; which models load as float32 (pure)
  backend_ops.py          which ops the backend runs in which dtypes (gather_mm: float32 only on the CPU); the weights plan at load (pure)
  cpu_linear.py           the CPU's float32 path: Linear and Embedding weights held transposed where they widen, a prompt's rows on 2 streams
  cpu_decode.py           the CPU's float32 path: its entry (prepare_float32), a decoded token in a quarter of the MLX ops (RoPE, RMSNorm, attention)
  cpu_encoder.py          BERT encoders on the CPU: softmax and GELU as fused polynomials, not MLX's scalar exp and erf
"""
