#!/usr/bin/env python3
"""Checks kvflow's tokenizer against HF `tokenizers` on a text file.

Builds HF tokenizers from a GGUF file's tokenizer metadata the way the model's real tokenizer.json
is made (byte-level BPE with the model's own pre_tokenizer sequence, and with the Llama-3 and
GPT-2 ones unless --own-pre-only; SentencePiece as transformers' LlamaConverter converts it: BPE
with byte_fallback, merges from the scores, the legacy "▁" normalizer), writes each as
tokenizer.json (+ tokenizer_config.json), and requires `tokenizer_dump` to produce exactly HF's
ids for the whole input and for a generated stress text (through --tokenizer-json, and through
--gguf for the GGUF's own pre-tokenizer).

  tokenizer_reference.py --gguf M.gguf --dump-bin build/tokenizer_dump --input valid.txt --workdir D
Exit status: 0 all equal, 1 mismatch or error, 77 skipped (model or input missing).
"""
import argparse
import os
import subprocess
import sys
import time

SKIP = 77

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"


def read_gguf_tokenizer(path):
    import gguf

    reader = gguf.GGUFReader(path)

    def field(name, default=None):
        f = reader.fields.get(name)
        if f is None:
            return default
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.STRING:
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            return [int(f.parts[i][0]) for i in f.data]
        if f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        return f.parts[f.data[0]][0].item()

    def floats(name):
        f = reader.fields[name]
        return [float(f.parts[i][0]) for i in f.data]

    model = field("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise SystemExit(f"{path}: tokenizer.ggml.model is {model!r}, "
                         "expected 'gpt2' (byte-level BPE) or 'llama' (SentencePiece)")
    spm = model == "llama"
    return {
        "model": model,
        "name": field("general.name", ""),
        "tokens": field("tokenizer.ggml.tokens"),
        "merges": [] if spm else field("tokenizer.ggml.merges"),
        "scores": floats("tokenizer.ggml.scores") if spm else None,
        "types": field("tokenizer.ggml.token_type"),
        "pre": "spm" if spm else field("tokenizer.ggml.pre", "gpt2"),
        "bos": field("tokenizer.ggml.bos_token_id", 1 if spm else -1),
        "eos": field("tokenizer.ggml.eos_token_id", 2 if spm else -1),
        "add_bos": bool(field("tokenizer.ggml.add_bos_token", spm)),
        "chat_template": field("tokenizer.chat_template", ""),
    }


def write_tokenizer_config(meta, path):
    """The tokenizer_config.json an HF model directory would have next to tokenizer.json."""
    import json

    tokens = meta["tokens"]
    config = {"add_bos_token": meta["add_bos"], "chat_template": meta["chat_template"]}
    if meta["bos"] >= 0:
        config["bos_token"] = tokens[meta["bos"]]
    if meta["eos"] >= 0:
        config["eos_token"] = tokens[meta["eos"]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)


def sentencepiece_merges(tokens, scores):
    """transformers' SentencePieceExtractor.extract(vocab_scores): every split of a piece into two
    pieces of the vocabulary is a merge, ranked by the piece's score (ties in vocabulary order)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores):
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda m: m[2], reverse=True)
    return [(l, r) for l, r, _ in merges]


def build_hf_spm(meta):
    """Llama-2's tokenizer.json: what LlamaConverter makes of a SentencePiece model."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens = meta["tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=sentencepiece_merges(tokens, meta["scores"]),
                               unk_token=tokens[0], fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    # Phi-3's special tokens swallow the whitespace after them (llama.cpp sets the same by name).
    phi3 = "phi3" in meta["name"].lower() or "phi-3" in meta["name"].lower()
    added = []
    for t, ty in zip(tokens, meta["types"]):
        if ty in (2, 3, 4):
            rstrip = phi3 and (ty != 1 or t == "</s>") and t not in ("<unk>", "<s>", "<|endoftext|>")
            added.append(AddedToken(t, special=ty != 4, normalized=False, rstrip=rstrip))
    tok.add_tokens(added)
    return tok


def build_hf_tokenizer(meta, pre):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    if pre == "spm":
        return build_hf_spm(meta)
    vocab = {}
    for i, t in enumerate(meta["tokens"]):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    # Llama-3's real tokenizer.json sets ignore_merges, which llama.cpp mirrors for llama-bpe.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=(pre == "llama-bpe")))
    split = lambda regex: pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("gpt2", "gpt-2"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in ("smollm", "starcoder"):
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre == "llama-bpe":
        tok.pre_tokenizer = pre_tokenizers.Sequence([split(LLAMA3_REGEX), byte_level])
    elif pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([split(QWEN2_REGEX), byte_level])
    elif pre == "falcon":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Punctuation("contiguous"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            pre_tokenizers.Digits(individual_digits=False),
            split("[0-9][0-9][0-9]"),
        ])
    elif pre == "deepseek-coder":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            split(r"[\r\n]"), split(r"\s?\p{L}+"), split(r"\s?\p{P}+"),
            split("[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"),
            pre_tokenizers.Digits(individual_digits=True), byte_level,
        ])
    else:
        raise SystemExit(f"pre-tokenizer {pre!r} has no HF reference here")
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, ty in zip(meta["tokens"], meta["types"]) if ty == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    # User-defined tokens are the tokenizer.json's other added tokens (DeepSeek-Coder's "\u00fc").
    added = [t for t, ty in zip(meta["tokens"], meta["types"]) if ty == 4]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


# Fragments whose mixtures stress the pre-tokenizer regexes: contractions in both cases, CR/LF and
# other whitespace (NBSP, U+3000, NEL; U+001C is not \s), non-ASCII digits, letters of several
# categories, combining marks, emoji sequences, special tokens and their look-alikes.
STRESS_FRAGMENTS = [
    "a", "Word", "UPPER", "'s", "'S", "'re", "'VE", "'Ll", "'d", "'x", "'", "''", "don't", "I'M",
    "0", "7", "42", "1234567", "3.14", "$1,000", "\u00bd", "\u00b2", "\u0663\u0664", "\u216b",
    " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n ", "\u00a0", "\u2009",
    "\u3000", "\u0085", "\u001c", "\u200b", "\u00ad", "\u01c5", "\u02b0", "\U0001d400",
    "\u6f22\u5b57", "\u3053\u3093\u306b\u3061\u306f", "\ud55c\uad6d\uc5b4",
    "\u0645\u0631\u062d\u0628\u0627", "\u041f\u0440\u0438\u0432\u0435\u0442", "e\u0301", "\U0001f600", "\U0001f44d\U0001f3fd",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467", "...", "!?", "--", "@", '"', "(", ")", "<", ">",
    "<|im_start|>", "<|im_end|>", "<|im_start", "|>", "<|endoftext|>", "http://x.y/z?q=1&r=2",
    "<s>", "</s>", "<unk>", "<|user|>", "<|end|>", "\u2581", "\u00fc", "e\u0301", "\u212b", "\ufb01",
    "\u00bc", "\u00b3", "$x", "+=", "^", "`", "\u3001", "\u30ab\u30ca", "\u0915\u094d\u0937",
]


def write_stress_text(path, fragments=20000, seed=1234):
    import random

    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("".join(rng.choice(STRESS_FRAGMENTS) for _ in range(fragments)))


def run_dump(dump_bin, source_args, input_path):
    start = time.perf_counter()
    proc = subprocess.run([dump_bin, *source_args, "--input", input_path],
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        return None, f"{' '.join(source_args)} failed ({proc.returncode}): {proc.stderr.strip()}"
    print(proc.stderr.strip())
    # The ids are the last line; model loading may log to stdout before it.
    lines = proc.stdout.rstrip("\n").split("\n")
    return [int(x) for x in lines[-1].split()], f"{elapsed:.2f} s"


def compare(label, expected, got, hf_tok):
    n = min(len(expected), len(got))
    first = next((i for i in range(n) if expected[i] != got[i]), None)
    if first is None and len(expected) == len(got):
        print(f"OK   {label}: {len(expected)} tokens identical")
        return True
    first = n if first is None else first
    lo, hi = max(0, first - 8), first + 8
    print(f"FAIL {label}: first mismatch at token {first} "
          f"(HF {len(expected)} tokens, kvflow {len(got)})")
    print(f"  HF     ids {expected[lo:hi]}  {[hf_tok.id_to_token(i) for i in expected[lo:hi]]}")
    print(f"  kvflow ids {got[lo:hi]}  {[hf_tok.id_to_token(i) for i in got[lo:hi]]}")
    print(f"  text around it: {hf_tok.decode(expected[lo:hi], skip_special_tokens=False)!r}")
    return False


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--dump-bin", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--own-pre-only", action="store_true",
                    help="only the GGUF's own pre-tokenizer, not also the Llama-3 and GPT-2 ones")
    args = ap.parse_args()

    for what, path in (("input", args.input), ("model", args.gguf)):
        if not os.path.exists(path):
            print(f"SKIP: {what} file {path} is missing")
            return SKIP
    if not os.access(args.dump_bin, os.X_OK):
        print(f"FAIL: {args.dump_bin} is not an executable tokenizer_dump")
        return 1
    try:
        import gguf  # noqa: F401
        import tokenizers  # noqa: F401
    except ImportError as e:
        print(f"SKIP: Python package missing: {e}")
        return SKIP

    meta = read_gguf_tokenizer(args.gguf)
    os.makedirs(args.workdir, exist_ok=True)
    stress_path = os.path.join(args.workdir, "stress.txt")
    write_stress_text(stress_path)

    ok = True
    pres = [meta["pre"]] if args.own_pre_only or meta["model"] != "gpt2" else [meta["pre"], "llama-bpe", "gpt2"]
    for pre in dict.fromkeys(pres):
        hf_tok = build_hf_tokenizer(meta, pre)
        json_path = os.path.join(args.workdir, pre, "tokenizer.json")
        os.makedirs(os.path.dirname(json_path), exist_ok=True)
        hf_tok.save(json_path)
        write_tokenizer_config(meta, os.path.join(args.workdir, pre, "tokenizer_config.json"))
        sources = [("tokenizer.json", ["--tokenizer-json", json_path])]
        if pre == meta["pre"]:
            sources.append(("gguf", ["--gguf", args.gguf]))
        for input_path in (args.input, stress_path):
            with open(input_path, "rb") as f:
                text = f.read().decode("utf-8")
            start = time.perf_counter()
            expected = hf_tok.encode(text, add_special_tokens=False).ids
            name = os.path.basename(input_path)
            print(f"HF   pre={pre} {name}: {len(expected)} tokens in "
                  f"{time.perf_counter() - start:.2f} s")
            for label, source_args in sources:
                got, info = run_dump(args.dump_bin, source_args, input_path)
                if got is None:
                    print(f"FAIL pre={pre} {name} via {label}: {info}")
                    ok = False
                    continue
                ok &= compare(f"pre={pre} {name} via {label} ({info})", expected, got, hf_tok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
