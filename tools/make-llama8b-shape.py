#!/usr/bin/env python3
"""Writes a GGUF with RANDOM weights in the shape of Llama 3.1-8B, for timing the paper's protocol.

Shape (Meta's config.json for Llama-3.1-8B): architecture llama, 32 layers, 32 heads, 8 KV heads,
head dim 128, hidden 4096, FFN 14336, vocabulary 128256, RoPE base 500000 with the llama3 rope
factors (rope_freqs.weight: factor 8, low/high frequency factors 1/4, original context 8192),
RMSNorm epsilon 1e-5, separate output.weight. Every matrix (the layers', token_embd and output) is
Q4_0, the norms F32: 4,520,414,656 bytes (4.21 GiB) in all, about the size of llama.cpp's Q4_0 of the model.

The weights are random: the text is noise, the timing is real. The Q4_0 codes are uniform
nibbles and each block's scale is drawn in [0.5, 1] x scale / 8, with scale = 1.7 / sqrt(columns)
for the matrices and 1 for the embeddings (the scheme of tests/model/tiny_llama.hpp
random_matrix), so activations stay O(1) through the 32 layers.

The tokenizer is the smallest valid byte-level BPE one (tokenizer.ggml.model gpt2, pre
llama-bpe): the 256 byte tokens (GPT-2's byte map), four merged tokens with their merges, filler
tokens <id> of type normal up to 128000, and Llama 3's 256 special tokens (<|begin_of_text|> =
128000 is BOS, <|end_of_text|> = 128001 is EOS, <|eot_id|> = 128009). `treeattn generate
--prompt-tokens N` draws its synthetic prompt among the normal ones.

Written streaming: the header and tensor directory first, then one tensor at a time (the largest,
token_embd, is 295 MB), so the process holds at most about two tensors. Refuses when the memory
available is under twice the file (the runs that follow map the whole file) or the disk lacks
room. Writes to NAME.partial and renames at the end, so an interrupted run leaves no half file.

Usage: make-llama8b-shape.py [--out models/Llama-3.1-8B-shape-random.Q4_0.gguf] [--seed 1]
                             [--layers 32] [--force]
(run it with build/ref-venv/bin/python: numpy and the gguf package; tools/ref-venv.sh makes it).
"""

import argparse
import math
import os
import shutil
import sys
import time

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("make-llama8b-shape: the gguf package is missing; run it with the python that "
             "tools/ref-venv.sh prints (build/ref-venv/bin/python)")

# Llama-3.1-8B.
N_EMBD = 4096
N_FF = 14336
N_HEAD = 32
N_HEAD_KV = 8
HEAD_DIM = 128
N_VOCAB = 128256
N_CTX_TRAIN = 131072
ROPE_BASE = 500000.0
RMS_EPS = 1e-5
# llama3 rope scaling (Llama 3.1's config.json rope_scaling).
ROPE_FACTOR = 8.0
ROPE_LOW_FREQ_FACTOR = 1.0
ROPE_HIGH_FREQ_FACTOR = 4.0
ROPE_ORIGINAL_CTX = 8192

N_NORMAL_END = 128000  # ids below are normal tokens, ids from here on Llama 3's specials
BOS, EOS, EOT = 128000, 128001, 128009

Q4_0 = gguf.GGMLQuantizationType.Q4_0
Q4_0_BLOCK = 32
Q4_0_BYTES = 18  # f16 scale + 16 bytes of nibbles


def q4_0_nbytes(rows, cols):
    return rows * (cols // Q4_0_BLOCK) * Q4_0_BYTES


def random_q4_0(rng, rows, cols, scale):
    """rows x cols Q4_0 as bytes (rows, cols / 32 * 18): value = d * (nibble - 8), the nibbles
    uniform and d uniform in [0.5, 1] * scale / 8 (tests/model/tiny_llama.hpp random_matrix)."""
    nb = rows * (cols // Q4_0_BLOCK)
    out = np.empty((nb, Q4_0_BYTES), dtype=np.uint8)
    d = (scale / 8.0) * (0.5 + 0.5 * rng.random(nb, dtype=np.float32))
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    out[:, 2:] = rng.integers(0, 256, size=(nb, 16), dtype=np.uint8)
    return out.reshape(rows, (cols // Q4_0_BLOCK) * Q4_0_BYTES)


def llama3_rope_factors():
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py writes it for rope_type llama3."""
    freqs = 1.0 / (ROPE_BASE ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM))
    low_wavelen = ROPE_ORIGINAL_CTX / ROPE_LOW_FREQ_FACTOR
    high_wavelen = ROPE_ORIGINAL_CTX / ROPE_HIGH_FREQ_FACTOR
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(ROPE_FACTOR)
        else:
            smooth = (ROPE_ORIGINAL_CTX / wavelen - ROPE_LOW_FREQ_FACTOR) / (
                ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR)
            factors.append(1.0 / ((1 - smooth) / ROPE_FACTOR + smooth))
    return np.array(factors, dtype=np.float32)


def gpt2_byte_tokens():
    """GPT-2's bytes_to_unicode: the text of the token of each byte, in byte order."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    text, extra = [], 256
    for b in range(256):
        if b in keep:
            text.append(chr(b))
        else:
            text.append(chr(extra))
            extra += 1
    return text


def vocabulary():
    tokens = gpt2_byte_tokens()
    merges = ["Ġ t", "h e", "i n", "Ġt he"]
    tokens += ["Ġt", "he", "in", "Ġthe"]
    tokens += [f"<{i}>" for i in range(len(tokens), N_NORMAL_END)]
    specials = [f"<|reserved_special_token_{i}|>" for i in range(N_VOCAB - N_NORMAL_END)]
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>",
             7: "<|end_header_id|>", 9: "<|eot_id|>"}
    for k, v in named.items():
        specials[k] = v
    tokens += specials
    types = [int(gguf.TokenType.NORMAL)] * N_NORMAL_END + \
            [int(gguf.TokenType.CONTROL)] * (N_VOCAB - N_NORMAL_END)
    assert len(tokens) == N_VOCAB and len(set(tokens)) == N_VOCAB
    return tokens, types, merges


def tensor_plan(n_layers):
    """(name, numpy shape in bytes or elements, kind, scale): the file's tensors in order."""
    plan = [("token_embd.weight", N_VOCAB, N_EMBD, "q", 1.0),
            ("rope_freqs.weight", None, HEAD_DIM // 2, "rope", None)]
    mat = lambda rows, cols: 1.7 / math.sqrt(cols)  # noqa: E731
    q_out, kv_out = N_HEAD * HEAD_DIM, N_HEAD_KV * HEAD_DIM
    for i in range(n_layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", None, N_EMBD, "norm", None),
                 (p + "attn_q.weight", q_out, N_EMBD, "q", mat(q_out, N_EMBD)),
                 (p + "attn_k.weight", kv_out, N_EMBD, "q", mat(kv_out, N_EMBD)),
                 (p + "attn_v.weight", kv_out, N_EMBD, "q", mat(kv_out, N_EMBD)),
                 (p + "attn_output.weight", N_EMBD, q_out, "q", mat(N_EMBD, q_out)),
                 (p + "ffn_norm.weight", None, N_EMBD, "norm", None),
                 (p + "ffn_gate.weight", N_FF, N_EMBD, "q", mat(N_FF, N_EMBD)),
                 (p + "ffn_up.weight", N_FF, N_EMBD, "q", mat(N_FF, N_EMBD)),
                 (p + "ffn_down.weight", N_EMBD, N_FF, "q", mat(N_EMBD, N_FF))]
    plan += [("output_norm.weight", None, N_EMBD, "norm", None),
             ("output.weight", N_VOCAB, N_EMBD, "q", 1.7 / math.sqrt(N_EMBD))]
    return plan


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def gib(n):
    return f"{n / 2**30:.2f} GiB"


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(root, "models",
                                                  "Llama-3.1-8B-shape-random.Q4_0.gguf"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--layers", type=int, default=32,
                    help="block count (32 is the model; fewer only to try the script quickly)")
    ap.add_argument("--force", action="store_true", help="rewrite an existing file")
    args = ap.parse_args()

    if os.path.exists(args.out) and not args.force:
        print(f"make-llama8b-shape: {args.out} exists (--force rewrites it)")
        return 0

    plan = tensor_plan(args.layers)
    data_bytes = sum(q4_0_nbytes(r, c) if k == "q" else 4 * c for _, r, c, k, _ in plan)
    avail = mem_available()
    if avail < 2 * data_bytes:
        sys.exit(f"make-llama8b-shape: refusing: the file is {gib(data_bytes)} and this machine "
                 f"has {gib(avail)} of memory available; the runs that use it need at least twice "
                 f"the file ({gib(2 * data_bytes)})")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    free_disk = shutil.disk_usage(out_dir).free
    if free_disk < data_bytes + (64 << 20):
        sys.exit(f"make-llama8b-shape: refusing: {out_dir} has {gib(free_disk)} free, the file "
                 f"needs {gib(data_bytes)}")

    partial = args.out + ".partial"
    w = gguf.GGUFWriter(partial, "llama", use_temp_file=False)
    w.add_name("Llama-3.1-8B shape, random weights (treeattn tools/make-llama8b-shape.py)")
    w.add_description("Random Q4_0 weights in Llama 3.1-8B's shape, for timing only; the text "
                      f"is noise. Seed {args.seed}.")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q4_0))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(args.layers)
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(N_VOCAB)
    tokens, types, merges = vocabulary()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(True)

    for name, rows, cols, kind, _ in plan:
        if kind == "q":
            w.add_tensor_info(name, (rows, cols // Q4_0_BLOCK * Q4_0_BYTES), np.dtype(np.uint8),
                              q4_0_nbytes(rows, cols), raw_dtype=Q4_0)
        else:
            w.add_tensor_info(name, (cols,), np.dtype(np.float32), 4 * cols)

    t0 = time.time()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(args.seed)
    written = 0
    for i, (name, rows, cols, kind, scale) in enumerate(plan):
        if kind == "q":
            t = random_q4_0(rng, rows, cols, scale)
        elif kind == "rope":
            t = llama3_rope_factors()
        else:  # RMSNorm gains near 1
            t = (1.0 + 0.1 * (rng.random(cols, dtype=np.float32) - 0.5)).astype(np.float32)
        w.write_tensor_data(t)
        written += t.nbytes
        del t
        if i % 45 == 44:
            print(f"make-llama8b-shape: {gib(written)} of {gib(data_bytes)} "
                  f"({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    w.close()
    os.replace(partial, args.out)
    size = os.path.getsize(args.out)
    print(f"make-llama8b-shape: wrote {args.out}: {size:,} bytes ({gib(size)}), "
          f"{len(plan)} tensors, in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
