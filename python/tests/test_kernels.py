"""decode_partial, merge_states, normalize and oracle against float64 numpy, and the exceptions
bad arguments raise (with the C++ message). Run: PYTHONPATH=<build>/python python3 -m unittest."""

import unittest

import numpy as np

import treeattn
from reference import attention, from_bf16_bits, rel_err, to_bf16_bits

TOL = 1e-5  # treeattn's oracle tolerance (docs/architecture.md)


def rand(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


class DecodePartialTest(unittest.TestCase):
    def check(self, B, Q, H, Hkv, D, N, dtype, seed, **kw):
        rng = np.random.default_rng(seed)
        q, k, v = rand(rng, B, Q, H, D), rand(rng, B, Hkv, N, D), rand(rng, B, Hkv, N, D)
        if dtype == "f16":
            k, v = k.astype(np.float16), v.astype(np.float16)
            kref, vref, args = k, v, {}
        elif dtype == "bf16":
            k, v = to_bf16_bits(k), to_bf16_bits(v)
            kref, vref, args = from_bf16_bits(k), from_bf16_bits(v), {"dtype": "bf16"}
        else:
            kref, vref, args = k, v, {}
        states = treeattn.decode_partial(q, k, v, **args, **kw)
        self.assertEqual(states.shape, (B, Q, H, D + 2))
        self.assertEqual(states.dtype, np.float32)
        out, lse = treeattn.normalize(states)
        ref_out, ref_lse = attention(q, kref, vref)
        err = rel_err(out, lse, ref_out, ref_lse)
        self.assertLessEqual(err, TOL, f"B={B} Q={Q} H={H} Hkv={Hkv} D={D} N={N} {dtype}")
        # The float64 oracle binding agrees with numpy to float64 rounding.
        o64, l64 = treeattn.oracle(q, k, v, **args)
        self.assertEqual(o64.dtype, np.float64)
        self.assertLess(np.abs(o64 - ref_out).max(), 1e-12)
        self.assertLess(np.abs(l64 - ref_lse).max(), 1e-12)

    def test_dtypes_and_shapes(self):
        cases = [(1, 1, 4, 4, 64, 37), (2, 1, 8, 2, 128, 300), (1, 3, 6, 3, 80, 129),
                 (3, 2, 4, 1, 96, 5), (1, 1, 2, 2, 256, 1000)]
        for i, c in enumerate(cases):
            for dtype in ("f32", "f16", "bf16"):
                self.check(*c, dtype, seed=i, threads=1)

    def test_isa_reference_and_chunks(self):
        self.check(2, 2, 8, 2, 64, 700, "f32", seed=9, isa="reference")
        self.check(2, 2, 8, 2, 64, 700, "bf16", seed=9, chunk_tokens=64)

    def test_causal_limit_positions_and_lengths(self):
        # A shard of a longer context: row b holds lengths[b] tokens at pos_start[b] + j * 2 of a
        # context of total_len[b]; with Q = 3, query i sees positions <= total_len - 3 + i.
        rng = np.random.default_rng(3)
        B, Q, H, Hkv, D, N = 3, 3, 4, 2, 64, 20
        q, k, v = rand(rng, B, Q, H, D), rand(rng, B, Hkv, N, D), rand(rng, B, Hkv, N, D)
        lengths, pos_start, total_len, stride = [20, 7, 0], [1, 30, 0], [41, 43, 5], 2
        states = treeattn.decode_partial(q, k, v, lengths=lengths, pos_start=pos_start,
                                         total_len=total_len, pos_stride=stride)
        pos = np.array([[s + j * stride if j < n else -1 for j in range(N)]
                        for s, n in zip(pos_start, lengths)])
        ref_out, ref_lse = attention(q, k, v, positions=pos, total_len=total_len)
        out, lse = treeattn.normalize(states)
        self.assertLessEqual(rel_err(out, lse, ref_out, ref_lse), TOL)
        self.assertTrue(np.isneginf(states[2, :, :, 0]).all(), "an empty row is the empty state")
        self.assertTrue((states[2, :, :, 1:] == 0).all())
        # Row 1: tokens at 30..42, context 43: query 0 sees <= 40 (6 tokens), query 2 all 7.
        self.assertTrue(np.isfinite(lse[1]).all())

    def test_strided_views_are_read_in_place(self):
        # A slice of a larger cache (token stride > head_dim) gives the same states as a copy.
        rng = np.random.default_rng(4)
        big_k, big_v = rand(rng, 2, 2, 50, 64), rand(rng, 2, 2, 50, 64)
        q = rand(rng, 2, 1, 4, 64)
        k, v = big_k[:, :, 10:40], big_v[:, :, 10:40]
        self.assertFalse(k.flags.c_contiguous)
        s_view = treeattn.decode_partial(q, k, v, pos_start=10)
        s_copy = treeattn.decode_partial(q, np.ascontiguousarray(k), np.ascontiguousarray(v),
                                         pos_start=10)
        np.testing.assert_array_equal(s_view, s_copy)
        # Heads-last layout [B, N, Hkv, D] viewed as [B, Hkv, N, D]: strides differ, still a view.
        kt = np.ascontiguousarray(big_k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        vt = np.ascontiguousarray(big_v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        np.testing.assert_array_equal(treeattn.decode_partial(q, kt, vt),
                                      treeattn.decode_partial(q, big_k, big_v))

    def test_explicit_scale(self):
        rng = np.random.default_rng(5)
        q, k, v = rand(rng, 1, 1, 2, 64), rand(rng, 1, 1, 9, 64), rand(rng, 1, 1, 9, 64)
        out, lse = treeattn.normalize(treeattn.decode_partial(q, k, v, scale=0.5))
        ref_out, ref_lse = attention(q, k, v, scale=0.5)
        self.assertLessEqual(rel_err(out, lse, ref_out, ref_lse), TOL)


class StatesTest(unittest.TestCase):
    def test_merge_of_two_shards_is_the_whole(self):
        rng = np.random.default_rng(6)
        B, Q, H, Hkv, D, N = 2, 2, 8, 4, 128, 101
        q, k, v = rand(rng, B, Q, H, D), rand(rng, B, Hkv, N, D), rand(rng, B, Hkv, N, D)
        cut = 40
        a = treeattn.decode_partial(q, k[:, :, :cut], v[:, :, :cut], total_len=N)
        b = treeattn.decode_partial(q, k[:, :, cut:], v[:, :, cut:], pos_start=cut, total_len=N)
        merged = treeattn.merge_states(a, b)
        out, lse = treeattn.normalize(merged)
        ref_out, ref_lse = attention(q, k, v)
        self.assertLessEqual(rel_err(out, lse, ref_out, ref_lse), TOL)
        # Commutative bit for bit; out= may alias either input.
        np.testing.assert_array_equal(merged, treeattn.merge_states(b, a))
        a2, b2 = a.copy(), b.copy()
        treeattn.merge_states(a2, b, out=a2)
        treeattn.merge_states(a, b2, out=b2)
        np.testing.assert_array_equal(a2, merged)
        np.testing.assert_array_equal(b2, merged)

    def test_empty_state_is_the_identity(self):
        rng = np.random.default_rng(7)
        x = treeattn.decode_partial(rand(rng, 1, 1, 2, 64), rand(rng, 1, 1, 5, 64),
                                    rand(rng, 1, 1, 5, 64))
        empty = np.zeros_like(x)
        empty[..., 0] = -np.inf
        np.testing.assert_array_equal(treeattn.merge_states(x, empty), x)
        np.testing.assert_array_equal(treeattn.merge_states(empty, x), x)
        e2 = treeattn.merge_states(empty, empty)
        np.testing.assert_array_equal(e2, empty)
        out, lse = treeattn.normalize(e2)
        self.assertTrue((out == 0).all() and np.isneginf(lse).all())

    def test_normalize_matches_numpy(self):
        rng = np.random.default_rng(8)
        s = rand(rng, 3, 5, 66)
        s[..., 1] = np.abs(s[..., 1]) + 1
        out, lse = treeattn.normalize(s)
        np.testing.assert_allclose(out, s[..., 2:] / s[..., 1:2], rtol=1e-6)
        np.testing.assert_allclose(lse, s[..., 0] + np.log(s[..., 1]), rtol=1e-6, atol=1e-6)


class ErrorsTest(unittest.TestCase):
    def setUp(self):
        rng = np.random.default_rng(10)
        self.q = rand(rng, 1, 1, 4, 64)
        self.k, self.v = rand(rng, 1, 2, 8, 64), rand(rng, 1, 2, 8, 64)

    def assert_raises(self, exc, message, fn, *args, **kw):
        with self.assertRaises(exc) as cm:
            fn(*args, **kw)
        self.assertEqual(str(cm.exception), message)
        return cm.exception

    def test_cpp_messages(self):
        rng = np.random.default_rng(11)
        e = self.assert_raises(ValueError, "heads (3) must be a multiple of kv_heads (2)",
                               treeattn.decode_partial, rand(rng, 1, 1, 3, 64), self.k, self.v)
        self.assertIsInstance(e, treeattn.InvalidArgumentError)
        self.assertIsInstance(e, treeattn.Error)
        self.assertEqual(e.code, "invalid argument")
        e = self.assert_raises(
            treeattn.UnsupportedError,
            "head_dim 59 is not supported (supported: 64, 80, 96, 128, 192, 256)",
            treeattn.decode_partial, rand(rng, 1, 1, 2, 59), rand(rng, 1, 1, 3, 59),
            rand(rng, 1, 1, 3, 59))
        self.assertIsInstance(e, RuntimeError)
        self.assertNotIsInstance(e, ValueError)
        self.assert_raises(ValueError, "unknown ISA 'sse9' (known: auto, reference, generic, avx2, "
                           "avx512)", treeattn.decode_partial, self.q, self.k, self.v, isa="sse9")
        self.assert_raises(ValueError, "KV shard position stride must be >= 1, got 0",
                           treeattn.decode_partial, self.q, self.k, self.v, pos_stride=0)
        self.assert_raises(ValueError, "batch row 0: negative KV length -1",
                           treeattn.decode_partial, self.q, self.k, self.v, lengths=-1)

    def test_binding_shape_checks(self):
        with self.assertRaisesRegex(ValueError, r"^q must be 4-D \[batch, q_len, heads, head_dim\], "
                                    r"got shape \(4, 64\)$"):
            treeattn.decode_partial(self.q[0, 0], self.k, self.v)
        with self.assertRaisesRegex(ValueError, "disagree on batch or head_dim"):
            treeattn.decode_partial(self.q, self.k[..., :32], self.v[..., :32])
        with self.assertRaisesRegex(ValueError, "k and v must have the same shape"):
            treeattn.decode_partial(self.q, self.k, self.v[:, :, :4])
        with self.assertRaisesRegex(ValueError, "lengths: 9 tokens in a row of k and v with 8"):
            treeattn.decode_partial(self.q, self.k, self.v, lengths=[9])
        with self.assertRaisesRegex(ValueError, "pos_start has 2 values for batch 1"):
            treeattn.decode_partial(self.q, self.k, self.v, pos_start=[0, 0])
        with self.assertRaisesRegex(ValueError, "head_dim contiguous"):
            wide = np.zeros((1, 2, 8, 128), np.float32)
            treeattn.decode_partial(self.q, wide[..., ::2], wide[..., ::2])
        with self.assertRaisesRegex(ValueError, "share their strides"):
            treeattn.decode_partial(self.q, self.k, np.asfortranarray(self.v))
        with self.assertRaisesRegex(ValueError, r"a \(2, 66\) and b \(3, 66\) differ in shape"):
            treeattn.merge_states(np.zeros((2, 66), np.float32), np.zeros((3, 66), np.float32))
        with self.assertRaisesRegex(ValueError, "state records"):
            treeattn.normalize(np.zeros((2, 1), np.float32))

    def test_dtypes_are_never_converted(self):
        with self.assertRaisesRegex(TypeError, "q must have dtype float32, got float64"):
            treeattn.decode_partial(self.q.astype(np.float64), self.k, self.v)
        with self.assertRaisesRegex(TypeError, "dtype=\"bf16\""):
            treeattn.decode_partial(self.q, self.k.view(np.uint16)[..., ::2].copy(),
                                    self.v.view(np.uint16)[..., ::2].copy())
        with self.assertRaisesRegex(TypeError, "float32 or float16"):
            treeattn.decode_partial(self.q, self.k.astype(np.float64), self.v.astype(np.float64))
        with self.assertRaisesRegex(TypeError, "same dtype"):
            treeattn.decode_partial(self.q, self.k, self.v.astype(np.float16))
        with self.assertRaisesRegex(TypeError, "needs k and v of numpy dtype uint16"):
            treeattn.decode_partial(self.q, self.k, self.v, dtype="bf16")
        with self.assertRaisesRegex(treeattn.UnsupportedError, "KV dtype fp8"):
            treeattn.decode_partial(self.q, self.k, self.v, dtype="fp8")


if __name__ == "__main__":
    unittest.main()
