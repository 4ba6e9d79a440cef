#!/usr/bin/env python3
"""Writes the expected token ids and tensor values that tests/model checks treeattn against.

Independent implementations, run outside CI (the outputs are committed as fixtures):
  * token ids: llama.cpp itself, through the PyPI package llama-cpp-python (which vendors
    llama.cpp), loading the model with vocab_only. For pre-tokenizers other than the file's own
    (`smollm`), the script writes vocab-only copies of the GGUF with tokenizer.ggml.pre changed
    (the `gguf` PyPI package's writer) and lets llama.cpp tokenize with those; the C++ test
    builds the same copies with its own writer.
  * tensor values: the `gguf` PyPI package's reader and numpy dequantizer (gguf.quants).

Usage: python3 tests/model/make_tokenizer_fixture.py [MODEL.gguf]
  (needs: pip install llama-cpp-python gguf numpy; the model from tools/model-path.sh)
Writes tests/model/data/tokenizer_ids.json and tests/model/data/smollm2_tensors.json.
"""
import json
import os
import subprocess
import sys
import tempfile
from importlib.metadata import version

import gguf
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# Strings covering ASCII, contractions, digits, whitespace runs, newlines, accents, scripts,
# CJK, emoji (with ZWJ and modifiers), code, Unicode whitespace and number categories, and
# special tokens.
CORPUS = [
    "The capital of France is",
    "Hello, world!",
    "Hello world",
    " Hello world",
    "  leading spaces",
    "trailing spaces   ",
    "a  b   c    d     e",
    "     ",
    " ",
    "\n",
    "\n\n\n",
    "tabs\tand\nnewlines\n\n\nend\n",
    "\r\n windows line\r\nendings\r\n",
    "1234567890",
    "In 2024, 3.14159 and 1,000,000 people paid $1.5M.",
    "x=42; y=-7.5e-3; z = 0x1F",
    "Year 2024 and 42 items, v1.2.3, a1b2c3, ٣٤ and ½ of 10%",
    "word\n\n  indented\n\t\ttabbed \n trailing\n",
    "I'm sure they'll say we've done what he'd do, it's fine, can't won't",
    "DON'T I'M YOU'RE THEY'LL",
    "'s 'S 'll 'LL hello'world",
    "Café déjà vu, naïve façade, Ærøskøbing, Łódź, São Paulo",
    "Ελληνικά κείμενα και Привет, мир! Ünïcödé ÅÇÉ ß ẞ",
    "日本語のテキスト、中文文本，한국어 텍스트。",
    "Emoji: 😀👍🏽🇫🇷 👨‍👩‍👧‍👦 ❤️ ✨",
    "def f(x):\n    return x**2  # square\n\n\nprint(f(3))\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    '<html><body class="x">&amp;&lt;</body></html>',
    "!!!???... ---- ==== $100 + <tag> ^ ~ | = @#%",
    "\u00a0nbsp\u2003em-space\u3000ideographic\u2028line-sep",
    "\x1c\x1d\x1e\x1f info separators",
    "a\u180eb mongolian vowel separator, a\u200bb zero width, a\u0085b next line",
    "ℕ ⅷ ② ¾ ٣٤٥ ໒໓ 𝟙𝟚",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 e\u0301 Ǆ ﬁ",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "Tree Attention merges partial softmax states (m, l, o) across ranks with an "
    "allreduce; Ring Attention passes the KV cache around instead.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|><|im_start|>",
    "<|im_start <|im_start|x <|IM_START|>",
    "",
]

# Pre-tokenizer names, each mapped by llama.cpp to a regex set.
PRES = ["smollm", "gpt-2", "llama-bpe", "default", "starcoder", "refact", "command-r",
        "codeshell", "exaone", "minerva-7b", "llama3", "llama-v3"]


def model_path():
    if len(sys.argv) > 1:
        return sys.argv[1]
    return subprocess.check_output([os.path.join(ROOT, "tools", "model-path.sh")],
                                   text=True).strip()


def vocab_copy(reader, pre, path, drop_add_bos):
    """A tensor-less copy of the model's metadata with tokenizer.ggml.pre = pre."""
    w = gguf.GGUFWriter(path, arch=reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "tokenizer.ggml.pre" or (drop_add_bos and key == "tokenizer.ggml.add_bos_token"):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=gguf.GGUFValueType(field.types[-1]))
        else:
            w.add_key_value(key, field.contents(), vtype)
    w.add_string("tokenizer.ggml.pre", pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenize_all(path):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    out = []
    for text in CORPUS:
        b = text.encode("utf-8")
        out.append({"text": text, "add_special": False, "parse_special": True,
                    "ids": llm.tokenize(b, add_bos=False, special=True)})
        if "<|" in text:
            out.append({"text": text, "add_special": False, "parse_special": False,
                        "ids": llm.tokenize(b, add_bos=False, special=False)})
    for text in CORPUS[:2]:
        out.append({"text": text, "add_special": True, "parse_special": True,
                    "ids": llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)})
    return out


def main():
    import llama_cpp
    model = model_path()
    reader = gguf.GGUFReader(model)
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pre in PRES:
            if pre == "smollm":
                path = model
            else:
                path = os.path.join(tmp, pre + ".gguf")
                # The llama-bpe family adds BOS by default: leave add_bos_token out there to
                # check that default.
                vocab_copy(reader, pre, path, drop_add_bos=pre in ("llama-bpe", "llama3"))
            cases[pre] = tokenize_all(path)
    fixture = {
        "model": os.path.basename(model),
        "source": "llama.cpp via llama-cpp-python %s (vocab_only); vocab copies drop "
                  "tokenizer.ggml.add_bos_token for llama-bpe and llama3" % llama_cpp.__version__,
        "drop_add_bos": ["llama-bpe", "llama3"],
        "cases": cases,
    }
    with open(os.path.join(HERE, "data", "tokenizer_ids.json"), "w", encoding="utf-8") as f:
        # One case per line (readable diffs); ASCII escapes keep control characters visible.
        head = {k: v for k, v in fixture.items() if k != "cases"}
        f.write(json.dumps(head)[:-1] + ',\n "cases": {\n')
        for k, (pre, cs) in enumerate(cases.items()):
            f.write('  "%s": [\n' % pre)
            f.write(",\n".join("   " + json.dumps(c) for c in cs))
            f.write("\n  ]%s\n" % ("," if k + 1 < len(cases) else ""))
        f.write(" }\n}\n")

    # Tensor values through the gguf package's numpy dequantizer.
    tensors = {}
    by_name = {t.name: t for t in reader.tensors}
    for name, rows in [("token_embd.weight", [0, 504, 49151]), ("blk.0.attn_q.weight", [0, 575]),
                       ("blk.29.ffn_down.weight", [7]), ("blk.0.attn_norm.weight", [0]),
                       ("output_norm.weight", [0])]:
        t = by_name[name]
        deq = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        deq = deq.reshape(-1, int(t.shape[0]))
        tensors[name] = {
            "type": t.tensor_type.name, "dims": [int(d) for d in t.shape],
            "n_bytes": int(t.n_bytes),
            "rows": {str(r): {"first8": deq[r, :8].tolist(), "sum": float(deq[r].sum()),
                              "sumsq": float((deq[r] ** 2).sum())} for r in rows},
        }
    with open(os.path.join(HERE, "data", "smollm2_tensors.json"), "w") as f:
        json.dump({"source": "gguf %s, gguf.quants.dequantize" % version("gguf"),
                   "tensors": tensors}, f, indent=1)
        f.write("\n")
    print("wrote", sum(len(v) for v in cases.values()), "tokenizer cases and",
          len(tensors), "tensors")


if __name__ == "__main__":
    main()
