#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention (flash backend), causal, fp16, on the shapes of
bench/cuda_bench.cc's prefill benchmark: the baseline kvflow's prefill kernel is quoted against.

Times with CUDA events after warm-up (median of repeats). GQA (8 KV heads) expands K/V to the
query heads outside the timed region when this torch has no enable_gqa. Writes JSON for
`kvflow_bench_cuda --sdpa-json`. Exits 77 without a CUDA GPU.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="1024,2048,4096,8192,16384")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("prefill_sdpa_torch: no torch", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("prefill_sdpa_torch: torch has no CUDA GPU", file=sys.stderr)
        return 77
    heads, dim = 32, 128
    rows = []
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        backend_ctx = lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])  # noqa: E731
    except ImportError:  # torch < 2.3
        backend_ctx = lambda: torch.backends.cuda.sdp_kernel(enable_flash=True, enable_math=False,  # noqa: E731
                                                             enable_mem_efficient=False)
    for kv_heads in (32, 8):
        for s in (int(t) for t in args.tokens.split(",")):
            q = torch.randn(1, heads, s, dim, device="cuda", dtype=torch.float16)
            k = torch.randn(1, kv_heads, s, dim, device="cuda", dtype=torch.float16)
            v = torch.randn(1, kv_heads, s, dim, device="cuda", dtype=torch.float16)
            if kv_heads != heads:
                k = k.repeat_interleave(heads // kv_heads, dim=1)
                v = v.repeat_interleave(heads // kv_heads, dim=1)
            with backend_ctx():
                for _ in range(3):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.cuda.synchronize()
                times = []
                for _ in range(5):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(5):
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    b.record()
                    b.synchronize()
                    times.append(a.elapsed_time(b) / 5)
            ms = sorted(times)[len(times) // 2]
            flops = 4.0 * s * s * heads * dim / 2
            rows.append({"tokens": s, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "time_ms": ms,
                         "tflops": flops / (ms * 1e-3) / 1e12})
            print(f"sdpa s={s:5d} kv={kv_heads:2d}: {ms:.3f} ms {rows[-1]['tflops']:.1f} TFLOP/s")
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "backend": "flash", "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
