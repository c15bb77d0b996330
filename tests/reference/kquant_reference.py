#!/usr/bin/env python3
"""kvflow's K-quant dequantization against gguf-py's (numpy, a port of ggml's dequantize_row_*_K).

Writes random Q2_K..Q6_K blocks into a GGUF file with gguf-py's GGUFWriter, has kvflow's GGUF reader
and dequantizer turn every tensor into fp32 (kvflow_tensor_dump), and requires the results to be
bit-identical to gguf.quants.dequantize. Random blocks cover every quant, sub-block scale and min
bit pattern; the f16 super-block scales are finite (random, plus zero, negative zero, subnormals and
the largest half). Exits 77 (skipped) when numpy or gguf is not installed.
"""
import argparse
import os
import subprocess
import sys

try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize
except ImportError as e:  # pragma: no cover
    print(f"skipping: {e}")
    sys.exit(77)

QK_K = 256
# block bytes and byte offsets of the f16 super-block scales (d, dmin) in ggml's block_q*_K
LAYOUTS = {
    Q.Q2_K: (84, [80, 82]),
    Q.Q3_K: (110, [108]),
    Q.Q4_K: (144, [0, 2]),
    Q.Q5_K: (176, [0, 2]),
    Q.Q6_K: (210, [208]),
}
SPECIAL_HALVES = np.array([0.0, -0.0, 6e-8, -3e-5, 6.1e-5, 65504.0, -65504.0, 1.0], dtype=np.float16)


def random_blocks(rng, qtype, blocks):
    block_bytes, f16_fields = LAYOUTS[qtype]
    data = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
    for field in f16_fields:
        halves = (rng.standard_normal(blocks) * 0.02).astype(np.float16)
        halves[: len(SPECIAL_HALVES)] = SPECIAL_HALVES[: blocks]
        rng.shuffle(halves)
        data[:, field:field + 2] = halves.view(np.uint8).reshape(blocks, 2)
    return data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump-bin", required=True, help="kvflow_tensor_dump")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--seed", type=int, default=20240601)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, "kquants.gguf")
    out_dir = os.path.join(args.workdir, "dump")

    rng = np.random.default_rng(args.seed)
    # [rows, columns]: one block, several rows, and a tensor big enough for kvflow's parallel path.
    shapes = [(1, 256), (3, 512), (64, 2048)]
    writer = gguf.GGUFWriter(path, "llama")
    expected = {}
    for qtype in LAYOUTS:
        for rows, cols in shapes:
            name = f"{qtype.name.lower()}_{rows}x{cols}"
            blocks = random_blocks(rng, qtype, rows * cols // QK_K).reshape(rows, -1)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
            expected[name] = dequantize(blocks, qtype).astype(np.float32)
            assert expected[name].shape == (rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    subprocess.run([args.dump_bin, path, out_dir], check=True)

    failures = 0
    for name, want in expected.items():
        got = np.fromfile(os.path.join(out_dir, name + ".f32"), dtype=np.float32)
        if got.size != want.size:
            print(f"{name}: kvflow wrote {got.size} values, expected {want.size}")
            failures += 1
            continue
        want = want.reshape(-1)
        same_bits = got.view(np.uint32) == want.view(np.uint32)
        # ulp distance on the ordered integer line of float32 bit patterns
        def ordered(v):
            i = v.view(np.int32).astype(np.int64)
            return np.where(i < 0, -(i & 0x7FFFFFFF), i)
        ulps = int(np.abs(ordered(got) - ordered(want)).max())
        max_abs = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())
        status = "bit-exact" if same_bits.all() else f"{(~same_bits).sum()} of {want.size} differ"
        print(f"{name:>18}: {want.size:7d} values, {status}, max |diff| {max_abs:.3g}, max ulps {ulps}")
        if not same_bits.all():
            i = int(np.argmin(same_bits))
            print(f"   first difference at {i}: kvflow {got[i]!r}, gguf-py {want[i]!r}")
            failures += 1
    if failures:
        print(f"FAIL: {failures} tensors differ from gguf-py")
        return 1
    print("PASS: every K-quant tensor is bit-identical to gguf-py's dequantization")
    return 0


if __name__ == "__main__":
    sys.exit(main())
