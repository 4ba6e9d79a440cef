"""One decode-session case, run by every rank of a treeattn Comm (in-process or MPI): builds the
same deterministic cache everywhere, stores the positions this rank owns, attends every layer,
appends tokens and attends again, and returns the worst relative error against float64 numpy
and a digest of the results (equal on every rank when the results are bit-identical)."""

import zlib

import numpy as np

import treeattn
from reference import attention, from_bf16_bits, rel_err, to_bf16_bits


def cache_values(x, dtype):
    if dtype == "bf16":
        return from_bf16_bits(to_bf16_bits(x))
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float32)
    return x


def run_case(comm, strategy="tree", placement="even", dtype="f32", batch=2, heads=4, kv_heads=2,
             head_dim=64, q_len=2, layers=2, context=(57, 30), steps=2, seed=0, root=-1,
             timeout=30.0):
    """Returns (max relative error over results this rank got, digest, results delivered)."""
    rng = np.random.default_rng(seed)
    ctx = list(context) if not isinstance(context, int) else [context] * batch
    total = max(ctx) + steps
    k = rng.standard_normal((layers, batch, total, kv_heads, head_dim), dtype=np.float32)
    v = rng.standard_normal((layers, batch, total, kv_heads, head_dim), dtype=np.float32)
    qs = rng.standard_normal((steps + 1, layers, batch, q_len, heads, head_dim), dtype=np.float32)
    kr, vr = cache_values(k, dtype), cache_values(v, dtype)

    s = treeattn.Session(comm, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         q_len=q_len, dtype=dtype, layers=layers, placement=placement,
                         context=ctx, strategy=strategy, root=root, timeout=timeout)
    for layer in range(layers):
        for b in range(batch):
            pos = s.owned_positions(b)
            assert all(s.owns(b, int(p)) for p in pos)
            s.store(layer, b, pos, k[layer, b, pos], v[layer, b, pos])
    worst, digest, delivered = 0.0, 0, 0
    for step in range(steps + 1):
        lens = [n + step for n in ctx]
        assert [s.length(b) for b in range(batch)] == lens
        for layer in range(layers):
            got = s.attend(layer, qs[step, layer])
            if got is None:
                continue
            out, lse = got
            delivered += 1
            # Reference per row: each row has its own length.
            for b in range(batch):
                n = lens[b]
                ref_out, ref_lse = attention(
                    qs[step, layer, b:b + 1],
                    kr[layer, b:b + 1, :n].transpose(0, 2, 1, 3),
                    vr[layer, b:b + 1, :n].transpose(0, 2, 1, 3))
                worst = max(worst, rel_err(out[b:b + 1], lse[b:b + 1], ref_out, ref_lse))
            digest = zlib.crc32(out.tobytes(), zlib.crc32(lse.tobytes(), digest))
        if step < steps:
            # Rows of different lengths: token `len` of each row is appended.
            kn = np.stack([k[:, b, lens[b]] for b in range(batch)], axis=1)
            vn = np.stack([v[:, b, lens[b]] for b in range(batch)], axis=1)
            s.append(kn, vn)
    return worst, digest, delivered
