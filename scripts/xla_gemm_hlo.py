"""Which GEMM does XLA run for [M, K] @ [K, N] bf16 here? Prints the optimized HLO's GEMM-related lines.

Usage: python scripts/xla_gemm_hlo.py [M K N]
"""
import re
import sys

import jax
import jax.numpy as jnp

M, K, N = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 8192, 2560)
x = jnp.ones((M, K), jnp.bfloat16)
w = jnp.ones((K, N), jnp.bfloat16)
text = jax.jit(lambda a, b: a @ b).lower(x, w).compile().as_text()
for line in text.splitlines():
    if re.search(r"custom_call_target|triton|cublas|fusion\(|transpose|copy\(", line):
        print(line.strip()[:400])
