"""Sequences in the decode session from Python (rows_start_free, add_sequence, remove_sequence,
extend(n, seq=...), store_range, attend(layer, q, seqs=...)) over the in-process communicator:
sequences join, grow and leave on 1 and 3 ranks under several placements and strategies, every
attention compared with float64 numpy softmax attention and bit-identical on every rank; and
the errors of bad calls (the session's messages, or the module's argument checks)."""

import unittest
import zlib

import numpy as np

import treeattn
from reference import attention, rel_err
from session_case import cache_values

TOL = 1e-5
SHAPE = dict(heads=4, kv_heads=2, head_dim=64)


class Model:
    """What every rank calls on its session, and the host-side K/V of each live sequence that
    the float64 reference reads (one rng, the same on every rank)."""

    def __init__(self, s, dtype, seed):
        self.s = s
        self.dtype = dtype
        self.rng = np.random.default_rng(seed)
        self.kv = {}  # seq -> (k, v) float32 [layers, len, kv_heads, head_dim] as stored
        self.worst = 0.0
        self.digest = 0
        self.delivered = 0

    def add(self):
        seq = self.s.add_sequence()
        empty = np.zeros((self.s.layers, 0, self.s.kv_heads, self.s.head_dim), np.float32)
        self.kv[seq] = (empty, empty)
        return seq

    def remove(self, seq):
        self.s.remove_sequence(seq)
        del self.kv[seq]

    def grow(self, seq, n):
        """Extends seq by n tokens and stores their K/V in every layer (grow, then store)."""
        s = self.s
        pos0 = s.length(seq)
        s.extend(n, seq=seq)
        assert s.length(seq) == pos0 + n
        shape = (s.layers, n, s.kv_heads, s.head_dim)
        k = self.rng.standard_normal(shape, dtype=np.float32)
        v = self.rng.standard_normal(shape, dtype=np.float32)
        for layer in range(s.layers):
            s.store_range(layer, seq, pos0, k[layer], v[layer])
        old_k, old_v = self.kv[seq]
        self.kv[seq] = (np.concatenate([old_k, cache_values(k, self.dtype)], axis=1),
                        np.concatenate([old_v, cache_values(v, self.dtype)], axis=1))

    def attend(self, seqs):
        """Attends every layer for seqs and checks each sequence against the reference."""
        s = self.s
        for layer in range(s.layers):
            q = self.rng.standard_normal((len(seqs), s.q_len, s.heads, s.head_dim),
                                         dtype=np.float32)
            got = s.attend(layer, q, seqs=seqs)
            if got is None:
                continue
            out, lse = got
            assert out.shape == q.shape and lse.shape == q.shape[:3], (out.shape, lse.shape)
            self.delivered += 1
            for i, seq in enumerate(seqs):
                k, v = self.kv[seq]
                ref_out, ref_lse = attention(q[i:i + 1], k[layer][None].transpose(0, 2, 1, 3),
                                             v[layer][None].transpose(0, 2, 1, 3))
                self.worst = max(self.worst, rel_err(out[i:i + 1], lse[i:i + 1], ref_out, ref_lse))
            self.digest = zlib.crc32(out.tobytes(), zlib.crc32(lse.tobytes(), self.digest))


def join_grow_leave(comm, strategy="tree", placement="even", dtype="f32", q_len=1, seed=0,
                    root=-1):
    """A serving-shaped run on 4 slots: sequences join with prompts of different lengths, decode
    together in changing orders, one leaves and a shorter one reuses its slot, the slots fill
    up. Returns (worst error, digest, attends delivered, what the slot calls returned)."""
    s = treeattn.Session(comm, batch=4, q_len=q_len, dtype=dtype, layers=2, placement=placement,
                         strategy=strategy, root=root, threads=1, timeout=30.0,
                         rows_start_free=True, **SHAPE)
    m = Model(s, dtype, seed)
    seen = [s.live_sequences()]
    a = m.add()
    m.grow(a, 13)                     # a prompt
    m.attend([a])
    b = m.add()
    m.grow(b, 5)                      # joins later, shorter
    m.attend([b, a])
    for _ in range(3):                # decode steps: q_len new tokens each
        for seq in (a, b):
            m.grow(seq, q_len)
        m.attend([a, b])
    m.remove(a)                       # a leaves; its slot is the lowest free one again
    seen += [s.live(a), s.live(b), s.live_sequences()]
    c = m.add()
    m.grow(c, max(q_len, 2))          # reuses a's slot with a much shorter sequence
    m.attend([c, b])
    m.attend([b])
    d, e = m.add(), m.add()
    m.grow(d, 9)
    m.grow(e, 1 + q_len)
    m.attend([e, c, d, b])
    seen += [a, b, c, d, e, s.live_sequences()]
    try:
        s.add_sequence()
        seen.append("no error")
    except treeattn.OutOfMemoryError as err:
        seen.append(str(err))
    m.remove(c)
    seen.append(m.add())
    return m.worst, m.digest, m.delivered, seen


class SequencesTest(unittest.TestCase):
    def run_all(self, p, **kw):
        results = treeattn.run_local(p, lambda comm: join_grow_leave(comm, **kw))
        for r, (worst, _, _, _) in enumerate(results):
            self.assertLessEqual(worst, TOL, f"rank {r} of {p}: {kw}")
        digests = {digest for _, digest, delivered, _ in results if delivered}
        self.assertEqual(len(digests), 1, f"p={p} {kw}: ranks differ")
        return results

    def test_join_grow_leave_on_one_and_three_ranks(self):
        for p in (1, 3):
            for placement in ("even", "uneven", "striped"):
                res = self.run_all(p, placement=placement, seed=p)
                _, _, delivered, seen = res[0]
                self.assertEqual(delivered, 2 * 8)  # 8 attends, 2 layers, every rank
                self.assertEqual(seen[:4], [0, False, True, 1])
                self.assertEqual(seen[4:10], [0, 1, 0, 2, 3, 4])  # c reuses a's slot
                self.assertEqual(seen[10], "rank 0: add_sequence: all 4 sequence slots are live "
                                           "(remove one, or create the session with a larger "
                                           "batch)")
                self.assertEqual(seen[11], 0)

    def test_strategies_dtypes_and_q_len(self):
        names = {n for n, _ in treeattn.local_world(1)[0].strategies()}
        for strategy in sorted(names & {"tree", "ring-kv", "allgather", "ring-state",
                                        "tree-det", "hier"}):
            self.run_all(3, strategy=strategy, seed=5)
        self.run_all(3, dtype="bf16", seed=6)
        self.run_all(3, dtype="f16", placement="striped", q_len=2, seed=7)
        self.run_all(1, q_len=3, seed=8)

    def test_root_delivers_to_one_rank(self):
        res = self.run_all(3, strategy="gather-root", root=1)
        self.assertEqual([n for _, _, n, _ in res], [0, 16, 0])

    def test_the_batch_calls_still_work_beside_sequence_calls(self):
        # rows_start_free=False (the default): every row is a live sequence from the start, and
        # one of them can still be attended alone.
        def body(comm):
            s = treeattn.Session(comm, batch=2, dtype="f32", context=[6, 4], threads=1, **SHAPE)
            self.assertEqual(s.live_sequences(), 2)
            m = Model(s, "f32", 3)
            # The rows exist already: fill them with store_range, positions 0 .. len - 1.
            for b in (0, 1):
                n = s.length(b)
                k = m.rng.standard_normal((1, n, 2, 64), dtype=np.float32)
                v = m.rng.standard_normal((1, n, 2, 64), dtype=np.float32)
                s.store_range(0, b, 0, k[0], v[0])
                m.kv[b] = (k, v)
            m.attend([1])
            m.grow(0, 1)
            m.attend([0, 1])
            return m.worst
        for worst in treeattn.run_local(2, body):
            self.assertLessEqual(worst, TOL)


class SequenceErrorsTest(unittest.TestCase):
    def session(self, comm, **kw):
        args = dict(batch=2, dtype="f32", threads=1, rows_start_free=True)
        args.update(SHAPE)
        args.update(kw)
        return treeattn.Session(comm, **args)

    def test_session_errors_reach_every_rank(self):
        def body(comm):
            r = comm.rank
            s = self.session(comm)
            msgs = []
            def expect(exc, fn, *args, **kw):
                with self.assertRaises(exc) as cm:
                    fn(*args, **kw)
                msgs.append(str(cm.exception))
            expect(ValueError, s.extend, 3)                     # the rows are free slots
            expect(ValueError, s.extend, 3, seq=0)              # not live yet
            expect(ValueError, s.extend, 3, seq=2)              # outside the slots
            expect(ValueError, s.extend, 3, seq=-1)
            expect(ValueError, s.remove_sequence, 1)
            a = s.add_sequence()
            expect(ValueError, s.extend, -1, seq=a)
            s.extend(4, seq=a)
            kv = np.zeros((2, 2, 64), np.float32)
            expect(ValueError, s.store_range, 0, a, 3, kv, kv)  # position 4 is not there yet
            expect(ValueError, s.store_range, 2, a, 0, kv, kv)  # no layer 2
            expect(ValueError, s.store_range, 0, 1, 0, kv, kv)  # not live
            q = np.zeros((2, 1, 4, 64), np.float32)
            expect(ValueError, s.attend, 0, q, seqs=[a, a])
            expect(ValueError, s.attend, 0, q, seqs=[a, 1])
            self.assertEqual(s.live_sequences(), 1)
            self.assertEqual(s.length(a), 4)
            self.assertFalse(s.live(-1))
            self.assertFalse(s.live(7))
            return msgs
        msgs = treeattn.run_local(2, body)
        for r, m in enumerate(msgs):
            p = f"rank {r}: "
            self.assertEqual(m[0], p + "extend(n) grows every row, but row 0 is a free sequence "
                                   "slot: grow sequences with extend(seq, n) and store_range")
            self.assertEqual(m[1], p + "extend: sequence 0 is not live (add_sequence() first)")
            self.assertEqual(m[2], p + "extend: sequence 2 is outside [0, 2)")
            self.assertEqual(m[3], p + "extend: sequence -1 is outside [0, 2)")
            self.assertEqual(m[4], p + "remove_sequence: sequence 1 is not live "
                                       "(add_sequence() first)")
            self.assertEqual(m[5], p + "extend: n must be >= 0, got -1")
            self.assertEqual(m[6], p + "store_range: positions 3 + 2 of sequence 0 are outside "
                                       "[0, 4) (extend the sequence first)")
            self.assertIn("layer 2 is outside [0, 1)", m[7])
            self.assertEqual(m[8], p + "store_range: sequence 1 is not live "
                                       "(add_sequence() first)")
            self.assertEqual(m[9], p + "attend: sequence 0 is listed twice")
            self.assertEqual(m[10], p + "attend: sequence 1 is not live (add_sequence() first)")

    def test_context_with_free_rows_is_refused(self):
        def body(comm):
            with self.assertRaises(treeattn.InvalidArgumentError) as cm:
                self.session(comm, context=3)
            return str(cm.exception)
        self.assertIn("rows_start_free: the rows are free sequence slots, so the context must "
                      "be empty", treeattn.run_local(1, body)[0])

    def test_bad_arguments(self):
        def body(comm):
            s = self.session(comm)
            a = s.add_sequence()
            s.extend(2, seq=a)
            kv = np.zeros((2, 2, 64), np.float32)
            with self.assertRaisesRegex(TypeError, "^n must be an int, got str$"):
                s.extend("2", seq=a)
            with self.assertRaisesRegex(TypeError, "^seq must be an int, got str$"):
                s.extend(2, seq="a")
            with self.assertRaisesRegex(ValueError, "^seq: 1180591620717411303424 does not fit"):
                s.extend(1, seq=2**70)
            with self.assertRaisesRegex(TypeError, "^seq must be an int, got NoneType$"):
                s.store_range(0, None, 0, kv, kv)
            with self.assertRaisesRegex(TypeError, "^pos0 must be an int, got float$"):
                s.store_range(0, a, 0.5, kv, kv)
            with self.assertRaisesRegex(ValueError, r"^k must be 3-D \[positions, kv_heads, "
                                        r"head_dim\], got shape \(2, 64\)$"):
                s.store_range(0, a, 0, kv[0], kv[0])
            with self.assertRaisesRegex(ValueError, r"^v must have shape \(2, 2, 64\) "
                                        r"\[positions, kv_heads, head_dim\], got \(1, 2, 64\)$"):
                s.store_range(0, a, 0, kv, kv[:1])
            with self.assertRaisesRegex(TypeError, "^k must have dtype float32"):
                s.store_range(0, a, 0, kv.astype(np.float64), kv)
            # Non-contiguous K is copied, not refused.
            wide = np.zeros((2, 2, 128), np.float32)
            s.store_range(0, a, 0, wide[:, :, ::2], kv)
            q = np.zeros((1, 1, 4, 64), np.float32)
            with self.assertRaisesRegex(ValueError, r"^q must have shape \(1, 1, 4, 64\) "
                                        r"\[len\(seqs\), q_len, heads, head_dim\], got "
                                        r"\(2, 1, 4, 64\)$"):
                s.attend(0, np.zeros((2, 1, 4, 64), np.float32), seqs=[a])
            with self.assertRaisesRegex(TypeError, "^seqs must be a sequence of ints"):
                s.attend(0, q, seqs="0")
            with self.assertRaisesRegex(TypeError, r"^seqs\[0\] must be an int, got float$"):
                s.attend(0, q, seqs=[0.0])
            with self.assertRaisesRegex(ValueError, "^seqs has 3 values, more than the 2 it "
                                        "can use$"):
                s.attend(0, q, seqs=[0, 1, 0])
            with self.assertRaisesRegex(ValueError, "^seqs has 1000000000000 values"):
                s.attend(0, q, seqs=range(10**12))
            # No sequences: nothing to attend, empty results.
            out, lse = s.attend(0, np.zeros((0, 1, 4, 64), np.float32), seqs=[])
            self.assertEqual((out.shape, lse.shape), ((0, 1, 4, 64), (0, 1, 4)))
            # Growth that could never fit is refused at once and leaves the session usable.
            with self.assertRaisesRegex(treeattn.OutOfMemoryError, "^rank 0: extend: "
                                        "4611686018427387904 more tokens of sequence 0 would "
                                        "put at least"):
                s.extend(2**62, seq=a)
            self.assertEqual(s.length(a), 2)
            s.extend(1, seq=a)
            out, _ = s.attend(0, q, seqs=[a])
            return out.shape
        self.assertEqual(treeattn.run_local(1, body), [(1, 1, 4, 64)])


if __name__ == "__main__":
    unittest.main()
