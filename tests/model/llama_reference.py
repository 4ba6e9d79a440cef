#!/usr/bin/env python3
"""Independent float64 reference of a Llama or Qwen2 GGUF model's forward pass (numpy + `gguf`).

Written from Hugging Face's modeling_llama conventions, not from treeattn's code: the weights are
dequantized with gguf.quants.dequantize, the Q and K rows are put back into Hugging Face's order
(undoing llama.cpp's converter permutation) and RoPE is applied in the rotate-half form. Agreement
with treeattn's adjacent-pair RoPE on the permuted weights is therefore a check of the convention,
not a restatement of it. qwen2 files are not permuted (llama.cpp rotates their halves, as Hugging
Face does), and their q/k/v biases are added after the projections.

Usage:
  llama_reference.py MODEL.gguf --tokens 1,2,3 --out logits.f64 [--positions all|last]
                     [--kv-round none|f16|bf16]
Writes the logits as raw little-endian float64, [positions][n_vocab], and prints a JSON summary
(shape, argmax per position) on stdout. --kv-round rounds K (after RoPE) and V to that type
before attention, as a KV cache of that dtype would hold them.
"""
import argparse
import json
import sys

import numpy as np

try:
    import gguf
except ImportError:  # the caller skips on exit code 77
    print("the gguf package is not installed (pip install gguf)", file=sys.stderr)
    sys.exit(77)


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def round_kv(x, kind):
    if kind == "none":
        return x
    if kind == "f16":
        return x.astype(np.float32).astype(np.float16).astype(np.float64)
    if kind == "bf16":
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
        return u.astype(np.uint32).view(np.float32).astype(np.float64)
    raise ValueError(kind)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--positions", default="last", choices=["all", "last"])
    ap.add_argument("--kv-round", default="none", choices=["none", "f16", "bf16"])
    a = ap.parse_args()
    toks = [int(t) for t in a.tokens.split(",") if t]

    r = gguf.GGUFReader(a.model)
    arch = field(r, "general.architecture")
    # llama: the converter permuted Wq/Wk rows (undone below); qwen2: not permuted, q/k/v biases.
    # gemma3: embeddings * sqrt(n_embd), per-head q/k RMSNorm, post norms, tanh-GELU, rope base
    # 10000 on sliding-window layers (every layer but each 6th), which see the last
    # attention.sliding_window positions only.
    assert arch in ("llama", "qwen2", "gemma3"), arch
    p = arch + "."
    n_layer = int(field(r, p + "block_count"))
    n_embd = int(field(r, p + "embedding_length"))
    n_head = int(field(r, p + "attention.head_count"))
    n_kv = int(field(r, p + "attention.head_count_kv", n_head))
    hd = int(field(r, p + "attention.key_length", n_embd // n_head))
    eps = float(field(r, p + "attention.layer_norm_rms_epsilon", 1e-5))
    base = float(field(r, p + "rope.freq_base", 10000.0))
    rope_dim = int(field(r, p + "rope.dimension_count", hd))
    assert rope_dim == hd, "the reference implements full-width RoPE only"
    scaling = field(r, p + "rope.scaling.type", "none")
    lin = float(field(r, p + "rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0

    tensors = {t.name: t for t in r.tensors}

    def W(name):  # numpy order: [rows, cols], float64
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
            int(t.shape[1]) if len(t.shape) > 1 else -1, -1)

    def vec(name):
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)

    def unpermute(w, heads):  # llama.cpp's converter permutation, undone
        if arch != "llama":
            return w
        rows = w.shape[0]
        return w.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows, -1)

    def rmsnorm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    T = len(toks)
    pos = np.arange(T, dtype=np.float64) / lin
    inv = base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    if "rope_freqs.weight" in tensors:
        inv = inv / vec("rope_freqs.weight")
    swa = int(field(r, p + "attention.sliding_window", 0)) if arch == "gemma3" else 0
    inv_local = float(field(r, p + "rope.freq_base_swa", 10000.0)) ** (
        -np.arange(0, hd, 2, dtype=np.float64) / hd)

    def rope(x, layer=None):  # x [T, heads, hd], rotate-half form
        local = swa > 0 and layer is not None and layer % 6 < 5
        ang = np.outer(np.arange(T, dtype=np.float64) if local else pos, inv_local if local else inv)
        cos = np.concatenate([np.cos(ang)] * 2, -1)    # [T, hd]
        sin = np.concatenate([np.sin(ang)] * 2, -1)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        rot = np.concatenate([-x2, x1], -1)
        return x * cos[:, None, :] + rot * sin[:, None, :]

    emb = W("token_embd.weight")
    x = emb[toks]                                   # [T, n_embd]
    if arch == "gemma3":
        x = x * np.sqrt(n_embd)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    g = n_head // n_kv
    for l in range(n_layer):
        b = "blk.%d." % l
        h = rmsnorm(x, vec(b + "attn_norm.weight"))
        q = h @ unpermute(W(b + "attn_q.weight"), n_head).T
        k = h @ unpermute(W(b + "attn_k.weight"), n_kv).T
        v = h @ W(b + "attn_v.weight").T
        for name, arr in (("attn_q.bias", "q"), ("attn_k.bias", "k"), ("attn_v.bias", "v")):
            if b + name in tensors:
                if arr == "q":
                    q = q + vec(b + name)
                elif arr == "k":
                    k = k + vec(b + name)
                else:
                    v = v + vec(b + name)
        q = q.reshape(T, n_head, hd)
        k = k.reshape(T, n_kv, hd)
        if arch == "gemma3":
            q = rmsnorm(q, vec(b + "attn_q_norm.weight"))
            k = rmsnorm(k, vec(b + "attn_k_norm.weight"))
        q = rope(q, l)
        k = round_kv(rope(k, l), a.kv_round)
        v = round_kv(v.reshape(T, n_kv, hd), a.kv_round)
        out = np.empty((T, n_head, hd))
        qd = n_head * hd
        m = mask
        if swa > 0 and l % 6 < 5:  # a sliding-window layer: keys q_pos - k_pos < swa only
            idx = np.arange(T)
            m = np.where(idx[:, None] - idx[None, :] >= swa, -np.inf, mask)
        for hh in range(n_head):
            s = q[:, hh, :] @ k[:, hh // g, :].T / np.sqrt(hd) + m
            s = np.exp(s - s.max(-1, keepdims=True))
            s /= s.sum(-1, keepdims=True)
            out[:, hh, :] = s @ v[:, hh // g, :]
        o = out.reshape(T, qd) @ W(b + "attn_output.weight").T
        if arch == "gemma3":
            o = rmsnorm(o, vec(b + "post_attention_norm.weight"))
        x = x + o
        h = rmsnorm(x, vec(b + "ffn_norm.weight"))
        gate = h @ W(b + "ffn_gate.weight").T
        up = h @ W(b + "ffn_up.weight").T
        if arch == "gemma3":
            act = 0.5 * gate * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (gate + 0.044715 * gate ** 3)))
        else:
            act = gate / (1.0 + np.exp(-gate))
        f = (act * up) @ W(b + "ffn_down.weight").T
        if arch == "gemma3":
            f = rmsnorm(f, vec(b + "post_ffw_norm.weight"))
        x = x + f
    x = rmsnorm(x, vec("output_norm.weight"))
    head = W("output.weight") if "output.weight" in tensors else emb
    rows = x if a.positions == "all" else x[-1:]
    logits = rows @ head.T
    logits.astype("<f8").tofile(a.out)
    print(json.dumps({"positions": int(logits.shape[0]), "n_vocab": int(logits.shape[1]),
                      "argmax": [int(i) for i in logits.argmax(-1)]}))


if __name__ == "__main__":
    main()
