"""Diagnosis: one decode step's attention for 4 rows over a long context, with
and without an array mask (mlx-lm's batch passes one for left padding), and
row by row; MLX's fused kernel against the unfused fallback. Prints ms per call."""
import sys
import time

import mlx.core as mx

L = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
B, H, KVH, D = 4, 32, 8, 128
q = mx.random.normal((B, H, 1, D)).astype(mx.bfloat16)
k = mx.random.normal((B, KVH, L, D)).astype(mx.bfloat16)
v = mx.random.normal((B, KVH, L, D)).astype(mx.bfloat16)
mask = mx.ones((B, 1, 1, L), dtype=mx.bool_)
mx.eval(q, k, v, mask)
scale = D ** -0.5


def timed(name, fn, n=50):
    for _ in range(5):
        mx.eval(fn())
    t = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    print(f"{name:40s} {1000 * (time.perf_counter() - t) / n:8.3f} ms")


sdpa = mx.fast.scaled_dot_product_attention
timed("fused, no mask", lambda: sdpa(q, k, v, scale=scale))
timed("fused, bool array mask", lambda: sdpa(q, k, v, scale=scale, mask=mask))
timed("fused, additive array mask", lambda: sdpa(q, k, v, scale=scale, mask=mx.where(mask, 0.0, -1e9).astype(mx.bfloat16)))
timed("row by row, no mask", lambda: [sdpa(q[i:i + 1], k[i:i + 1], v[i:i + 1], scale=scale) for i in range(B)])
kv_read_gb = 2 * B * KVH * L * D * 2 / 1e9
print(f"K and V: {kv_read_gb:.2f} GB a step")
