"""`kvflow tokenize`: llama-tokenize's output from a vocabulary-only GGUF or a tokenizer.json.

The ids are llama.cpp's test vectors for the 8 real vocabularies of ../shared (Hugging Face's ids);
the unit tests check every vector, these check what the command prints and refuses.
"""
import subprocess

import pytest

from conftest import REPO

VOCABS = REPO.parent / "shared" / "datasets" / "tokenizer_vocabs"


def vectors(name):
    gguf = VOCABS / f"ggml-vocab-{name}.gguf"
    if not gguf.exists():
        pytest.skip(f"no {gguf} (the ../shared datasets)")
    texts = (VOCABS / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = (VOCABS / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    return gguf, [(t, [int(x) for x in i.split()]) for t, i in zip(texts, ids)]


def tokenize(cli_bin, *args, check=True):
    r = subprocess.run([cli_bin, "tokenize", *args], capture_output=True, timeout=60)
    if check:
        assert r.returncode == 0, r.stderr.decode()
    return r


@pytest.mark.parametrize("name", ["llama-spm", "qwen2", "falcon"])
def test_list_is_hugging_faces_ids(cli_bin, name):
    gguf, cases = vectors(name)
    for text, ids in [c for c in cases if c[0].strip()][:6]:
        out = tokenize(cli_bin, "--model", str(gguf), "--text", text, "--list", "--no-bos").stdout.decode()
        assert out == "[" + ", ".join(map(str, ids)) + "]\n", text


def test_pieces_bos_and_count_as_llama_tokenize(cli_bin):
    gguf, _ = vectors("llama-spm")
    out = tokenize(cli_bin, "--model", str(gguf), "--text", "Hello world", "--show-count").stdout.decode()
    # llama-tokenize: BOS where the model adds it, "%6d -> '%s'" per token, the piece's own space.
    assert out == "     1 -> '<s>'\n 15043 -> ' Hello'\n  3186 -> ' world'\nTotal number of tokens: 3\n"


def test_special_tokens_parse_only_when_asked(cli_bin):
    gguf, _ = vectors("llama-spm")
    plain = tokenize(cli_bin, "-m", str(gguf), "-p", "a</s>", "--list", "--no-bos").stdout.decode()
    special = tokenize(cli_bin, "-m", str(gguf), "-p", "a</s>", "--list", "--no-bos", "--parse-special").stdout.decode()
    assert ", 2]" not in plain and special.endswith(", 2]\n")


def test_ids_decode_back_to_the_text(cli_bin, tmp_path):
    gguf, cases = vectors("phi-3")
    text, ids = next(c for c in cases if "\n" not in c[0] and len(c[1]) > 3)
    out = tokenize(cli_bin, "--model", str(gguf), "--ids", ", ".join(map(str, ids))).stdout.decode()
    assert out == text + "\n"
    path = tmp_path / "prompt.txt"
    path.write_text(text, encoding="utf-8")
    listed = tokenize(cli_bin, "--model", str(gguf), "--file", str(path), "--list", "--no-bos").stdout.decode()
    assert listed == "[" + ", ".join(map(str, ids)) + "]\n"


@pytest.mark.parametrize("args,message", [
    (["--ids", "1 banana"], "'banana' is not a token id"),
    (["--ids", "99999999"], "outside the vocabulary"),
    (["--file", "/nonexistent/prompt.txt"], "cannot read"),
    ([], "give --text, --file, --stdin or --ids"),
])
def test_bad_input_is_a_clear_error(cli_bin, args, message):
    gguf, _ = vectors("gpt-2")
    r = tokenize(cli_bin, "--model", str(gguf), *args, check=False)
    assert r.returncode == 1 and message in r.stderr.decode(), r.stderr.decode()


def test_a_tokenizer_it_cannot_run_is_refused(cli_bin, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": {"type": "Unigram", "vocab": []}}')
    r = tokenize(cli_bin, "--model", str(path), "--text", "x", check=False)
    assert r.returncode == 1 and "Unigram" in r.stderr.decode()
