#!/usr/bin/env python3
"""Writes the GGUF fuzz seeds in tests/fuzz/corpus_gguf (run with a python that has gguf and numpy):
small files with a tensor of each K-quant type and the older block formats, plus broken variants
(truncated data, an offset that lies, a K-quant row of 128 elements) so the fuzzer starts next to
the checks. The seeds are committed; rerun this only to change them."""
import os
import struct
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_gguf")
K_BLOCK_BYTES = {Q.Q2_K: 84, Q.Q3_K: 110, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
K_F16_FIELDS = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}


def k_blocks(rng, qtype, rows, blocks_per_row):
    data = rng.integers(0, 256, size=(rows * blocks_per_row, K_BLOCK_BYTES[qtype]), dtype=np.uint8)
    for field in K_F16_FIELDS[qtype]:
        data[:, field:field + 2] = (rng.standard_normal(len(data)) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


def write(name, tensors):
    path = os.path.join(OUT, name)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    for tname, data, qtype in tensors:
        w.add_tensor(tname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(path, "rb") as f:
        return bytearray(f.read())


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(1)
    for qtype in K_BLOCK_BYTES:
        write(f"{qtype.name.lower()}.gguf", [(f"blk.0.{qtype.name.lower()}.weight", k_blocks(rng, qtype, 2, 1), qtype)])
    mixed = [
        ("token_embd.weight", k_blocks(rng, Q.Q4_K, 1, 2), Q.Q4_K),
        ("blk.0.attn_v.weight", k_blocks(rng, Q.Q6_K, 1, 1), Q.Q6_K),
        ("blk.0.attn_k.weight", k_blocks(rng, Q.Q5_K, 1, 1), Q.Q5_K),
        ("blk.0.attn_q.weight", gguf.quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), Q.Q8_0), Q.Q8_0),
        ("blk.0.ffn_up.weight", gguf.quants.quantize(rng.standard_normal((1, 64)).astype(np.float32), Q.Q4_0), Q.Q4_0),
        ("output_norm.weight", rng.standard_normal(8).astype(np.float32), None),
    ]
    full = write("mixed.gguf", mixed)
    with open(os.path.join(OUT, "mixed_truncated.gguf"), "wb") as f:
        f.write(full[: len(full) - 100])
    # Tensor "b" claims to start at offset 64, inside tensor "a".
    one = write("q4_k_lying_offset.gguf", [("a", k_blocks(rng, Q.Q4_K, 1, 1), Q.Q4_K), ("b", k_blocks(rng, Q.Q4_K, 1, 1), Q.Q4_K)])
    at = one.rfind(b"\x01\x00\x00\x00\x00\x00\x00\x00b") + 9  # name length, name, then n_dims u32
    n_dims = struct.unpack_from("<I", one, at)[0]
    at += 4 + 8 * n_dims + 4  # dims, type: the offset
    one[at:at + 8] = struct.pack("<Q", 64)
    with open(os.path.join(OUT, "q4_k_lying_offset.gguf"), "wb") as f:
        f.write(one)
    # A Q4_K row of 128 elements: whole 32-blocks but not a super-block; written as a 256 one, patched.
    ragged = write("q4_k_ragged_row.gguf", [("r", k_blocks(rng, Q.Q4_K, 2, 1), Q.Q4_K)])
    at = ragged.rfind(b"r") + 1 + 4
    ragged[at:at + 8] = struct.pack("<Q", 128)
    with open(os.path.join(OUT, "q4_k_ragged_row.gguf"), "wb") as f:
        f.write(ragged)
    write_tokenizer_seeds()
    print(f"wrote {len(os.listdir(OUT))} seeds to {OUT}")


def write_tokenizer_seeds():
    """Vocabulary-only files: a SentencePiece one (scores, <0xXX> byte tokens) and a byte-level BPE
    one (merges, a pre-tokenizer), so the fuzzer starts inside both tokenizer loaders."""
    spm = gguf.GGUFWriter(os.path.join(OUT, "vocab_spm.gguf"), "llama")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581", "a", "\u2581a"]
    spm.add_tokenizer_model("llama")
    spm.add_token_list(tokens)
    spm.add_token_scores([0.0] * 259 + [-1.0, -1.0, -0.5])
    spm.add_token_types([2, 3, 3] + [6] * 256 + [1, 1, 1])
    spm.add_bos_token_id(1)
    spm.add_eos_token_id(2)
    bpe = gguf.GGUFWriter(os.path.join(OUT, "vocab_bpe.gguf"), "llama")
    bpe.add_tokenizer_model("gpt2")
    bpe.add_tokenizer_pre("falcon")
    bpe.add_token_list(["a", "b", "ab", "\u0120", "<|end|>"])
    bpe.add_token_merges(["a b"])
    bpe.add_token_types([1, 1, 1, 1, 3])
    for w in (spm, bpe):
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


if __name__ == "__main__" and sys.argv[1:] == ["--tokenizer-only"]:
    write_tokenizer_seeds()
elif __name__ == "__main__":
    sys.exit(main())
