"""Property test of the module's argument conversion (issue 23): every public function and
argument gets random shapes, strides (non-contiguous, negative, Fortran order, broadcast, huge
broadcast views), dtypes (float16/32/64, ints, bool, object, complex), None, scalars, strings,
lists and huge lazy sequences. Each call must return or raise TypeError, ValueError, MemoryError
or RuntimeError (treeattn.Error's subclasses are among them); it must never crash or hang the
interpreter.

Most calls start from valid arguments and replace one or two of them, so that a bad argument
reaches the code behind the checks of the others. The calls run in a child interpreter under a
4 GiB address-space limit (an allocation the checks let through fails there instead of taking
the machine's memory); a crash or hang fails the test and names the last call. Seeded, so a
failure reproduces with: python3 test_fuzz.py --child SEED CALLS
"""

import math
import os
import random
import resource
import subprocess
import sys
import unittest

import numpy as np

SEED = 23
CALLS = 4000
ALLOWED = (TypeError, ValueError, MemoryError, RuntimeError)

FLOAT_DTYPES = [np.float16, np.float32, np.float64]
OTHER_DTYPES = [np.int32, np.int64, np.uint16, np.bool_, np.complex64, object]
HUGE = 2**40


# ---- random values -------------------------------------------------------------------------------

class Gen:
    def __init__(self, seed):
        self.r = random.Random(seed)
        self.np = np.random.default_rng(seed)

    def pick(self, seq):
        return seq[self.r.randrange(len(seq))]

    def chance(self, p):
        return self.r.random() < p

    def small_int(self):
        return self.pick([0, 1, 2, 3, 4, 5, 7, 16, -1, -2])

    def edge_int(self):
        return self.pick([-2**63, 2**63 - 1, 2**63, 2**64, -2**64, 2**70, 2**31, 2**31 - 1,
                          -2**31, 2**40, 2**62, True, False, np.int64(3), np.int32(-1),
                          np.uint64(2**64 - 1), np.array(2), np.array([1, 2])])

    def float_(self):
        return self.pick([0.0, -0.0, 1.0, -1.0, 0.125, math.nan, math.inf, -math.inf, 1e300,
                          1e-45, np.float32(0.5), np.float64(math.nan)])

    def string(self):
        return self.pick(["", "abc", "f32", "f16", "bf16", "fp8", "int8", "tree", "tree-det",
                          "ring-kv", "single", "hier", "even", "uneven", "striped", "explicit",
                          "auto", "reference", "avx512", "\x00", "\u00e9" * 3])

    def other(self):
        return self.pick([None, [], [1, 2], [[1]], ["a"], (1.5,), {}, {"a": 1}, object(),
                          b"xx", range(2**62), [None], [2**70], [-1, -1], 1j, [1.5, 2.5],
                          np.zeros(3, np.int64), np.zeros(2, np.float32)])

    def junk(self):
        kind = self.r.randrange(6)
        if kind == 0:
            return self.small_int()
        if kind == 1:
            return self.edge_int()
        if kind == 2:
            return self.float_()
        if kind == 3:
            return self.string()
        if kind == 4:
            return self.array()
        return self.other()

    def int_arg(self):
        """A value for an integer argument: mostly ints, sometimes anything."""
        return self.small_int() if self.chance(0.5) else (
            self.edge_int() if self.chance(0.6) else self.junk())

    def values(self, shape, dtype):
        if dtype is object:
            a = np.empty(shape, object)
            a.flat[:] = [self.pick([None, 1, 1.5, "x"]) for _ in range(a.size)]
            return a
        if np.issubdtype(dtype, np.complexfloating):
            return (self.np.standard_normal(shape) + 1j).astype(dtype)
        if np.issubdtype(dtype, np.floating):
            a = self.np.standard_normal(shape).astype(dtype)
            if a.size and self.chance(0.2):
                a.flat[self.r.randrange(a.size)] = self.pick([math.nan, math.inf, -math.inf])
            return a
        return self.np.integers(0, 3, shape).astype(dtype)

    def block(self, shape):
        """float32 values of a session's shape; a broadcast view when that shape is huge (a
        session may have been made with heads=2**40)."""
        if math.prod(shape) > 1_000_000:
            return np.broadcast_to(np.zeros((), np.float32), shape)
        return self.values(shape, np.float32)

    def relayout(self, a):
        """The same values (or a view of them) with other strides or flags."""
        how = self.r.randrange(8)
        if how == 0 and a.ndim >= 1:  # every other element of a wider array
            wide = np.repeat(a, 2, axis=-1)
            return wide[..., ::2]
        if how == 1 and a.ndim >= 1:  # negative stride
            return np.flip(a, axis=self.r.randrange(a.ndim))
        if how == 2 and a.ndim >= 2:
            return np.asfortranarray(a)
        if how == 3 and a.ndim >= 1:  # stride 0 along one axis
            axis = self.r.randrange(a.ndim)
            one = np.take(a, [0], axis=axis) if a.shape[axis] else a
            return np.broadcast_to(one, a.shape)
        if how == 4:
            a = a.copy()
            a.setflags(write=False)
            return a
        if how == 5 and a.ndim >= 1:  # a huge view along one axis
            axis = self.r.randrange(a.ndim)
            one = np.take(a, [0], axis=axis) if a.shape[axis] else np.zeros(
                a.shape[:axis] + (1,) + a.shape[axis + 1:], a.dtype)
            shape = list(a.shape)
            shape[axis] = self.pick([2**34, HUGE, 2**46])
            return np.broadcast_to(one, tuple(shape))
        if how == 6 and a.size:  # not aligned to its dtype
            raw = np.zeros(a.nbytes + 1, np.uint8)[1:]
            try:
                b = raw.view(a.dtype).reshape(a.shape)
            except (ValueError, TypeError):
                return a
            b[...] = a
            return b
        return a

    def array(self, shape=None, dtype=None):
        if shape is None:
            dims = [self.pick([0, 1, 2, 3, 4, 8, 64, 66, 130]) for _ in range(self.r.randrange(6))]
            while math.prod(dims) > 100_000:  # a few hundred kB at most
                dims[dims.index(max(dims))] = 1
            shape = tuple(dims)
        if dtype is None:
            dtype = self.pick(FLOAT_DTYPES + OTHER_DTYPES) if self.chance(0.5) else np.float32
        a = self.values(shape, dtype)
        return self.relayout(a) if self.chance(0.5) else a

    def mutate_array(self, a):
        """A near miss of a valid array: another dtype, layout or shape."""
        how = self.r.randrange(4)
        if how == 0:
            return a.astype(self.pick(FLOAT_DTYPES + OTHER_DTYPES))
        if how == 1:
            return self.relayout(a)
        if how == 2 and a.ndim:
            shape = list(a.shape)
            i = self.r.randrange(len(shape))
            shape[i] = self.pick([0, 1, shape[i] + 1, max(shape[i] - 1, 0)])
            return self.values(tuple(shape), a.dtype)
        if how == 3:
            return a.reshape((1,) + a.shape) if self.chance(0.5) else a.reshape(-1)
        return a

    def maybe(self, valid, p=0.15):
        """valid, or (with probability p) a replacement: a near miss for arrays, junk otherwise."""
        if not self.chance(p):
            return valid
        if isinstance(valid, np.ndarray) and self.chance(0.6):
            return self.mutate_array(valid)
        return self.junk()


# ---- the calls ---------------------------------------------------------------------------------

def kernel_call(g, treeattn):
    B, Q = g.pick([1, 2]), g.pick([1, 2])
    Hkv = g.pick([1, 2])
    H = Hkv * g.pick([1, 2])
    D = g.pick([64, 64, 80, 128])
    N = g.pick([0, 1, 5, 17])
    kv_dtype = g.pick(["f32", "f16", "bf16"])
    q = g.values((B, Q, H, D), np.float32)
    k = g.values((B, Hkv, N, D), np.float32)
    v = g.values((B, Hkv, N, D), np.float32)
    kw = {}
    if kv_dtype == "f16":
        k, v = k.astype(np.float16), v.astype(np.float16)
    elif kv_dtype == "bf16":
        k, v = (k.view(np.uint32) >> 16).astype(np.uint16), (v.view(np.uint32) >> 16).astype(
            np.uint16)
        kw["dtype"] = "bf16"
    if g.chance(0.3):  # a slice of a longer cache, as the kernel takes it
        kw["lengths"] = g.pick([N, max(N - 1, 0), [N] * B])
        kw["pos_start"] = g.pick([0, 3, [0] * B])
        kw["pos_stride"] = g.pick([1, 2])
    args = [g.maybe(q), g.maybe(k), g.maybe(v)]
    names = ["dtype", "scale", "lengths", "pos_start", "total_len", "pos_stride"]
    for name in names:
        if g.chance(0.15):
            kw[name] = g.int_arg() if name not in ("dtype", "scale") else (
                g.string() if name == "dtype" and g.chance(0.6) else g.junk())
    fn = treeattn.oracle
    if g.chance(0.6):
        fn = treeattn.decode_partial
        kw["threads"] = 1
        for name in ("threads", "chunk_tokens", "isa"):
            if g.chance(0.15):
                kw[name] = g.string() if name == "isa" and g.chance(0.6) else g.int_arg()
    return fn, args, kw


def state_call(g, treeattn):
    shape = tuple(g.pick([1, 2, 3]) for _ in range(g.r.randrange(4))) + (g.pick([2, 3, 66]),)
    a, b = g.values(shape, np.float32), g.values(shape, np.float32)
    if g.chance(0.5):
        return treeattn.normalize, [g.maybe(a, 0.5)], {}
    kw = {}
    if g.chance(0.4):
        kw["out"] = g.maybe(np.zeros(shape, np.float32), 0.5)
    return treeattn.merge_states, [g.maybe(a, 0.3), g.maybe(b, 0.3)], kw


def world_call(g, treeattn):
    size = g.pick([1, 2, 3]) if g.chance(0.6) else g.int_arg()
    if g.chance(0.3) and isinstance(size, int) and 1 <= size <= 3:
        return treeattn.run_local, [size, g.pick([lambda c: c.rank, lambda c: c.size, None,
                                                  lambda c: int("x") if c.rank else 0])], {}
    kw = {}
    if g.chance(0.4):
        kw["node_of_rank"] = g.pick([[0] * size if isinstance(size, int) and 0 <= size < 9
                                     else None, [-1], g.junk()])
    if g.chance(0.1):
        return treeattn.mpi_comm, [g.pick([0, "world", object(), 3.5])], {}
    return treeattn.local_world, [size], kw


SESSION_INTS = ["batch", "heads", "kv_heads", "head_dim", "q_len", "layers", "holder",
                "reserve_tokens", "root", "fanout", "threads"]


def session_config(g):
    kw = dict(batch=g.pick([1, 2]), heads=4, kv_heads=g.pick([1, 2, 4]), head_dim=64,
              q_len=g.pick([1, 2]), dtype=g.pick(["f32", "f16", "bf16", "fp8", "int8"]),
              layers=g.pick([1, 2]), placement=g.pick(["even", "uneven", "striped"]),
              context=g.pick([0, 3, 9]), threads=1, timeout=1.0)
    if g.chance(0.2):
        kw.update(placement="explicit", context=4, explicit_len=[4])
    if g.chance(0.2):
        kw.update(strategy=g.pick(["tree", "tree2", "ring-kv", "allgather", "single"]))
    if g.chance(0.3):  # sequence slots: no context, no per-row explicit lengths
        kw.update(rows_start_free=True, context=0, placement=g.pick(["even", "striped"]))
        kw.pop("explicit_len", None)
    return kw


def session_ctor_call(g, treeattn, comm):
    kw = session_config(g)
    for _ in range(g.pick([1, 1, 2])):
        name = g.pick(SESSION_INTS + ["dtype", "placement", "context", "explicit_len",
                                      "strategy", "node_of_rank", "scale", "isa", "timeout",
                                      "check_agreement", "agree_also", "rows_start_free",
                                      "comm"])
        if name in SESSION_INTS:
            kw[name] = g.int_arg()
        elif name in ("dtype", "placement", "strategy", "isa"):
            kw[name] = g.string() if g.chance(0.7) else g.junk()
        elif name in ("scale", "timeout"):
            kw[name] = g.float_() if g.chance(0.7) else g.junk()
        elif name == "comm":
            comm = g.pick([None, 0, "comm", [comm], treeattn.Comm,
                           treeattn.Comm.__new__(treeattn.Comm)])
        else:
            kw[name] = g.junk() if g.chance(0.6) else g.int_arg()
    return treeattn.Session, [comm], kw


def session_method_call(g, s, treeattn):
    L, B, Hkv, D, H, Q = s.layers, s.batch, s.kv_heads, s.head_dim, s.heads, s.q_len
    kv1 = g.block((Hkv, D))
    n = g.pick([0, 1, 3])
    seqs = g.pick([[], [0], [B - 1, 0], [0, 0]])
    calls = [
        ("length", [g.pick([0, B - 1])]),
        ("owns", [0, g.pick([0, 1, 5])]),
        ("shard_lengths", []),
        ("shard_starts", [g.pick([None, 0])]),
        ("owned_positions", [0]),
        ("extend", [g.pick([0, 1, 2])]),
        ("store", [0, 0, 0, kv1, kv1]),
        ("store", [0, 0, [0], kv1[None], kv1[None].copy()]),
        ("append", [g.block((L, B, Hkv, D)), g.block((L, B, Hkv, D))]),
        ("attend", [0, g.block((B, Q, H, D))]),
        ("attend_states", [0, g.block((B, Q, H, D))]),
        ("delivers_result", [0]),
        ("add_strategy", [g.pick(["tree", "allgather", "nope", "ring-kv"])]),
        ("check_agreement", [g.pick(["", "now"]), g.pick([[], [("a", "b")]])]),
        ("add_sequence", []),
        ("remove_sequence", [g.pick([0, B - 1, B])]),
        ("live", [g.pick([0, B, -1])]),
        ("live_sequences", []),
        ("extend", [g.pick([0, 1, 2])], {"seq": g.pick([0, B - 1])}),
        ("store_range", [0, g.pick([0, B - 1]), g.pick([0, 1]), g.block((n, Hkv, D)),
                         g.block((n, Hkv, D))]),
        ("attend", [0, g.block((len(seqs), Q, H, D))], {"seqs": seqs}),
    ]
    name, args, *rest = g.pick(calls)
    kw = dict(rest[0]) if rest else {}
    if args and g.chance(0.8):
        args = list(args)
        for _ in range(g.pick([1, 1, 2])):
            i = g.r.randrange(len(args))
            args[i] = g.maybe(args[i], 1.0) if g.chance(0.5) else g.int_arg()
    if kw and g.chance(0.5):
        key = g.pick(list(kw))
        kw[key] = g.maybe(kw[key], 1.0) if g.chance(0.5) else g.int_arg()
    return getattr(s, name), args, kw


def describe(fn, args, kw):
    def short(x):
        if isinstance(x, np.ndarray):
            return (f"ndarray(shape={x.shape}, dtype={x.dtype}, strides={x.strides}, "
                    f"writeable={x.flags.writeable})")
        text = repr(x)
        return text if len(text) <= 60 else text[:57] + "..."
    parts = [short(a) for a in args] + [f"{k}={short(v)}" for k, v in kw.items()]
    return f"{getattr(fn, '__qualname__', fn)}({', '.join(parts)})"


def child(seed, calls):
    # Any allocation the checks let through fails at 4 GiB instead of taking the machine's memory.
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    import warnings
    warnings.simplefilter("ignore")  # numpy's casts of NaN to ints, and the like
    import treeattn
    g = Gen(seed)
    comm = treeattn.local_world(1)[0]
    session = None
    outcomes = {}
    unexpected = []
    for i in range(calls):
        kind = g.r.randrange(10)
        try:
            fn, args, kw = make_call(g, kind, treeattn, comm, session)
        except Exception:  # noqa: BLE001  (numpy refused to build this value: draw again)
            continue
        text = describe(fn, args, kw)
        print(f"{i}: {text}", flush=True)
        try:
            result = fn(*args, **kw)
        except ALLOWED as e:
            # A bad argument is the caller's error: an internal error, or a RuntimeError that is
            # not one of the module's, means it got past the checks.
            if isinstance(e, treeattn.InternalError) or (
                    isinstance(e, RuntimeError) and not isinstance(e, treeattn.Error)):
                unexpected.append(f"{text} raised {type(e).__name__}: {e}")
                continue
            outcomes[type(e).__name__] = outcomes.get(type(e).__name__, 0) + 1
            print(f"  -> {type(e).__name__}: {str(e)[:200]!r}", flush=True)
            continue
        except Exception as e:  # noqa: BLE001  (the property under test)
            unexpected.append(f"{text} raised {type(e).__name__}: {e}")
            continue
        outcomes["returned"] = outcomes.get("returned", 0) + 1
        if isinstance(result, treeattn.Session) and result.size == 1:
            session = result
    print("OUTCOMES", sorted(outcomes.items()), flush=True)
    for u in unexpected[:20]:
        print("UNEXPECTED", u, flush=True)
    return 1 if unexpected else 0


def make_call(g, kind, treeattn, comm, session):
    if kind < 3:
        return kernel_call(g, treeattn)
    if kind < 5:
        return state_call(g, treeattn)
    if kind < 6:
        return world_call(g, treeattn)
    if kind < 7 or session is None:
        return session_ctor_call(g, treeattn, comm)
    if g.chance(0.02):  # an instance whose __init__ never ran
        fn, args, kw = session_method_call(g, session, treeattn)
        blank = treeattn.Session.__new__(treeattn.Session)
        return getattr(blank, fn.__name__), args, kw
    return session_method_call(g, session, treeattn)


class FuzzTest(unittest.TestCase):
    def test_random_arguments_never_crash(self):
        seed = int(os.environ.get("TREEATTN_FUZZ_SEED", SEED))
        calls = int(os.environ.get("TREEATTN_FUZZ_CALLS", CALLS))
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(seed), str(calls)]
        env = dict(os.environ, PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            last = [ln for ln in out.splitlines() if ln[:1].isdigit()][-1:] or ["(none)"]
            self.fail(f"seed {seed}: still running after 100 s; last call: {last[0]}")
        lines = p.stdout.strip().splitlines()
        if p.returncode < 0 or p.returncode not in (0, 1):
            last = [ln for ln in lines if ln[:1].isdigit()][-1:]
            self.fail(f"seed {seed}: the child died (exit {p.returncode}) during "
                      f"{last[0] if last else '(no call)'}\n{p.stderr[-3000:]}")
        bad = [ln for ln in lines if ln.startswith("UNEXPECTED")]
        self.assertEqual(bad, [], f"seed {seed}: exceptions outside {ALLOWED}")
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        summary = [ln for ln in lines if ln.startswith("OUTCOMES")]
        self.assertTrue(summary, p.stdout[-2000:])
        # The calls must reach past the argument checks too, not only be refused.
        self.assertIn("'returned'", summary[0])
        print(f"\nseed {seed}, {calls} calls: {summary[0]}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child(int(sys.argv[2]), int(sys.argv[3])))
    unittest.main()
