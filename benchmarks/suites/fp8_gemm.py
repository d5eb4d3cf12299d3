"""FP8 against bf16 GEMMs on one device: the copy-engine executor's FP8 and bf16 chunk matmuls
(cuBLASLt, timed through the contention probe) beside JAX's bf16 dot, FP8 dot and
dequantize-then-dot, on the per-device anchor shapes; every product verified before it is timed
(ficco_jax/tools/gemm_rates.py says what each variant is and how it is timed).

    python benchmarks/suites/fp8_gemm.py --out DIR [--shape M,K,N ...] [--variants V,...] [--repeats R1,R2]
                                         [--xla-cache DIR]

`--variants executor_bf16,jax_bf16 --shape ...` compares the executor's bf16 chunk matmul with XLA's
dot of the same shape alone, without the FP8 dots' autotuning (seconds per shape instead of a minute).

Writes DIR/fp8_gemm.json (with provenance) and DIR/fp8_gemm.md, and prints the table last. On CPU
the anchors are divided by 64 and the times mean nothing.
"""
from __future__ import annotations

import argparse
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # CPU runs: 8 devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

from ficco_jax.tools import gemm_rates  # noqa: E402
from ficco_jax.tools.harness import use_xla_cache  # noqa: E402
from ficco_jax.tools.report import progress_printer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "out/fp8", help="results dir (default $OUT, else out/fp8)")
    p.add_argument("--shape", action="append", help="M,K,N per device (repeatable; default: the five anchors, "
                                                    "on CPU divided by 64)")
    p.add_argument("--variants", default=",".join(gemm_rates.VARIANTS),
                   help="the variants to time, comma-separated (default: all, %(default)s)")
    p.add_argument("--repeats", default=",".join(map(str, gemm_rates.REPEATS)),
                   help="R1,R2: matmuls per probe call of the difference method (default %(default)s)")
    p.add_argument("--xla-cache", metavar="DIR", default=None,
                   help="JAX's persistent compilation cache with XLA's autotuning results, so the FP8 dots' "
                        "autotuning is paid once per machine (default: $FICCO_XLA_CACHE or ~/.cache/ficco_jax/xla; "
                        "'none': off)")
    args = p.parse_args(argv)
    try:
        args.repeats = tuple(int(v) for v in args.repeats.split(","))
        assert len(args.repeats) == 2 and 1 <= args.repeats[0] < args.repeats[1]
    except (ValueError, AssertionError):
        p.error(f"--repeats {args.repeats!r}: expected R1,R2 with 1 <= R1 < R2, e.g. 2,6")
    args.variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in args.variants if v not in gemm_rates.VARIANTS]
    if unknown or not args.variants:
        p.error(f"--variants {','.join(unknown) or '(none)'}: choose from {','.join(gemm_rates.VARIANTS)}")
    shapes = {}
    for text in args.shape or []:
        try:
            M, K, N = (int(v) for v in text.split(","))
        except ValueError:
            p.error(f"--shape {text!r}: expected M,K,N, three integers, e.g. 8192,8192,7168")
        shapes[f"M{M}_K{K}_N{N}"] = (M, K, N)
    args.shapes = shapes
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    use_xla_cache(args.xla_cache)
    default = gemm_rates.CPU_GEMMS if jax.default_backend() == "cpu" else gemm_rates.ANCHOR_GEMMS
    shapes = args.shapes or default
    progress = progress_printer(len(shapes) * len(args.variants))
    result = gemm_rates.run(args.out, shapes, args.repeats, progress, variants=args.variants)
    print(gemm_rates.markdown(result), end="")
    rows = [r for s in result["shapes"] for r in s["variants"].values()]
    return 1 if any(r.get("verified") is False or r.get("note", "").startswith("error") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
