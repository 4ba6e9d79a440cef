#!/usr/bin/env python3
"""Distributed exact attention decoding from Python, checked against numpy.

    PYTHONPATH=build/release/python mpirun -np 4 python3 examples/python/decode.py

Every rank builds the same deterministic KV cache in numpy, creates a treeattn.Session over
mpi4py's COMM_WORLD, stores only the positions it owns (the placement decides which), attends
every layer, appends decoded tokens and attends again. Each rank compares every result with a
float64 numpy softmax over the whole cache (relative error as treeattn's own check defines it:
max |out - ref| / max(1, max |ref|), and |lse - ref| / max(1, |ref|)) and checks that all ranks
got the same bits. Rank 0
prints one line; every rank exits 1 when any check failed on any rank.
"""

import argparse
import sys
import zlib

import numpy as np
from mpi4py import MPI

try:
    import treeattn
except ImportError as e:
    sys.exit(f"decode.py: cannot import treeattn ({e}); set PYTHONPATH=<build dir>/python")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="tree", help="tree, tree-paper, ring-kv, allgather, ...")
    p.add_argument("--placement", default="even", help="even, uneven, striped")
    p.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"], help="KV cache dtype")
    p.add_argument("--seq", type=int, default=1000, help="prompt tokens per batch row")
    p.add_argument("--steps", type=int, default=2, help="decoded tokens appended after the prompt")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--q-len", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--tol", type=float, default=1e-5, help="largest relative error accepted")
    return p.parse_args()


def as_cache_dtype(x, dtype):
    """The float32 values the cache holds after narrowing to dtype (round to nearest even)."""
    if dtype == "f16":
        return x.astype(np.float16).astype(np.float32)
    if dtype == "bf16":
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.astype(np.uint32).view(np.float32)
    return x


def reference(q, k, v, n):
    """float64 softmax attention of q [B, Q, H, D] over k, v [B, n, Hkv, D] (the first n tokens);
    query i sees positions <= n - Q + i. Returns (out [B, Q, H, D], lse [B, Q, H])."""
    b_, q_len, heads, d = q.shape
    group = heads // k.shape[2]
    kk = np.repeat(k[:, :n].astype(np.float64), group, axis=2)  # [B, n, H, D]
    vv = np.repeat(v[:, :n].astype(np.float64), group, axis=2)
    logits = np.einsum("bqhd,bnhd->bqhn", q.astype(np.float64), kk) / np.sqrt(d)
    visible = np.arange(n)[None, :] <= (n - q_len + np.arange(q_len))[:, None]  # [Q, n]
    logits = np.where(visible[None, :, None, :], logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True)
    w = np.exp(logits - m)
    den = w.sum(axis=-1, keepdims=True)
    out = np.einsum("bqhn,bnhd->bqhd", w / den, vv)
    return out, (m + np.log(den))[..., 0]


def main():
    a = parse_args()
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    L, B, H, Hkv, D, Q = a.layers, a.batch, a.heads, a.kv_heads, a.head_dim, a.q_len
    total = a.seq + a.steps

    # The same cache and queries on every rank: [layers, batch, tokens, kv_heads, head_dim].
    rng = np.random.default_rng(a.seed)
    k_all = rng.standard_normal((L, B, total, Hkv, D), dtype=np.float32)
    v_all = rng.standard_normal((L, B, total, Hkv, D), dtype=np.float32)
    queries = rng.standard_normal((a.steps + 1, L, B, Q, H, D), dtype=np.float32)
    k_ref, v_ref = as_cache_dtype(k_all, a.dtype), as_cache_dtype(v_all, a.dtype)

    comm = treeattn.mpi_comm(world)
    s = treeattn.Session(comm, batch=B, heads=H, kv_heads=Hkv, head_dim=D, q_len=Q,
                         dtype=a.dtype, layers=L, placement=a.placement, context=a.seq,
                         strategy=a.strategy, reserve_tokens=a.steps, timeout=60)
    # Prefill: each rank stores the positions it owns, and only those.
    stored = 0
    for layer in range(L):
        for b in range(B):
            pos = s.owned_positions(b)
            s.store(layer, b, pos, k_all[layer, b, pos], v_all[layer, b, pos])
            stored += len(pos)

    worst_out = worst_lse = 0.0
    digest = 0
    for step in range(a.steps + 1):
        n = a.seq + step
        for layer in range(L):
            q = queries[step, layer]
            out, lse = s.attend(layer, q)
            ref_out, ref_lse = reference(q, k_ref[layer], v_ref[layer], n)
            out_err = np.abs(out - ref_out).max() / max(1.0, np.abs(ref_out).max())
            worst_out = max(worst_out, float(out_err))
            lse_err = np.abs(lse - ref_lse) / np.maximum(1.0, np.abs(ref_lse))
            worst_lse = max(worst_lse, float(lse_err.max()))
            digest = zlib.crc32(out.tobytes(), zlib.crc32(lse.tobytes(), digest))
        if step < a.steps:  # decode: the next token of every row and layer, stored by its owner
            s.append(np.ascontiguousarray(k_all[:, :, n]), np.ascontiguousarray(v_all[:, :, n]))

    ok = worst_out <= a.tol and worst_lse <= a.tol
    digests = world.allgather(digest)
    same = all(d == digests[0] for d in digests)
    verdicts = world.allgather(ok)
    stored_all = world.allgather(stored)
    worst_out = world.allreduce(worst_out, op=MPI.MAX)
    worst_lse = world.allreduce(worst_lse, op=MPI.MAX)
    good = all(verdicts) and same
    if rank == 0:
        bad = [r for r, v in enumerate(verdicts) if not v]
        print(f"decode.py: {'ok' if good else 'WRONG'}: {size} ranks, {a.strategy}, "
              f"{a.placement}, {a.dtype}, B={B} H={H} Hkv={Hkv} D={D} Q={Q}, {L} layers, "
              f"{a.seq} -> {total} tokens (stored per rank: {stored_all}), "
              f"max rel err {worst_out:.1e} (out) {worst_lse:.1e} (lse) vs float64 numpy"
              + (f" [ranks over {a.tol:g}: {bad}]" if bad else "")
              + (", identical on every rank" if same else ", results DIFFER between ranks"),
              flush=True)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
