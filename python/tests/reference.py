"""float64 numpy references for the Python tests: softmax attention with treeattn's causal rule
(shape.hpp), bf16/f16 rounding, and the relative error treeattn's own check uses."""

import numpy as np


def to_bf16_bits(x):
    """float32 -> bfloat16 bits (uint16), round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def attention(q, k, v, positions=None, total_len=None, scale=None):
    """float64 attention of q [B, Q, H, D] over k, v [B, Hkv, N, D] (already the values the kernel
    sees, any float dtype). positions [B, N]: global position of each token (default 0..N-1);
    total_len [B]: context length, query i sees positions <= total_len - Q + i (default N);
    a token with a negative position is absent. Returns (out [B, Q, H, D], lse [B, Q, H]);
    rows that see nothing get out 0 and lse -inf."""
    B, Q, H, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    if positions is None:
        positions = np.tile(np.arange(N), (B, 1))
    if total_len is None:
        total_len = np.full(B, N)
    scale = 1.0 / np.sqrt(D) if scale is None or scale == 0 else scale
    g = H // Hkv
    kk = np.repeat(k.astype(np.float64), g, axis=1)  # [B, H, N, D]
    vv = np.repeat(v.astype(np.float64), g, axis=1)
    logits = np.einsum("bqhd,bhnd->bqhn", q.astype(np.float64), kk) * scale
    limit = np.asarray(total_len)[:, None] - Q + np.arange(Q)[None, :]  # [B, Q]
    pos = np.asarray(positions)
    visible = (pos[:, None, :] <= limit[:, :, None]) & (pos[:, None, :] >= 0)  # [B, Q, N]
    logits = np.where(visible[:, :, None, :], logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(logits - m_safe)
    den = w.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.einsum("bqhn,bhnd->bqhd", np.where(den > 0, w / den, 0.0), vv)
        lse = np.where(den[..., 0] > 0, m_safe[..., 0] + np.log(den[..., 0]), -np.inf)
    return out, lse


def rel_err(out, lse, ref_out, ref_lse):
    """The larger of max|out - ref| / max(1, max|ref|) and the LSE's |lse - ref| / max(1, |ref|)
    (the metric of treeattn's compare_with_reference); -inf LSEs must match exactly."""
    e_out = np.abs(out.astype(np.float64) - ref_out).max() / max(1.0, np.abs(ref_out).max())
    fin = np.isfinite(ref_lse)
    if not np.array_equal(fin, np.isfinite(lse)):
        return np.inf
    e_lse = 0.0
    if fin.any():
        d = np.abs(lse[fin].astype(np.float64) - ref_lse[fin]) / np.maximum(1.0, np.abs(ref_lse[fin]))
        e_lse = d.max()
    return max(float(e_out), float(e_lse))
