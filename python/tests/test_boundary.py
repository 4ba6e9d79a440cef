"""Bad arguments at the Python boundary raise a Python exception that names the argument, and
never crash or hang the interpreter (issue 23, items 1-5). Each case runs in a child interpreter
(child.py), so a case that still crashes fails its test instead of killing the runner."""

import re
import time
import unittest

import numpy as np

import treeattn
import child

SESSION = "c = treeattn.local_world(1)[0]\n"


class BoundaryTest(unittest.TestCase):
    def assert_child_raises(self, code, exc, pattern, timeout=60):
        what, names, message = child.outcome(code, timeout)
        self.assertNotEqual(what, "crashed", f"{code!r}: {message}")
        self.assertEqual(what, "raised", f"{code!r} returned instead of raising {exc}")
        self.assertIn(exc, names, f"{code!r} raised {names[0]}: {message}")
        self.assertRegex(message, pattern, code)
        return message

    # ---- item 1: thread counts -------------------------------------------------------------------
    def test_thread_counts_out_of_range_are_refused(self):
        dp = ("q = np.zeros((1, 1, 2, 64), np.float32); k = np.zeros((1, 1, 8, 64), np.float32)\n"
              "treeattn.decode_partial(q, k, k, threads={})")
        for t in (100000, 1025, -1, 2**31, 2**63):
            self.assert_child_raises(dp.format(t), "ValueError",
                                     rf"^threads {t}: must be between 0 \(the default\) and 1024 "
                                     r"\(more threads only oversubscribe the cores\)$")
        ses = SESSION + "treeattn.Session(c, heads=4, kv_heads=2, head_dim=64, threads={})"
        for t in (100000, -3):
            self.assert_child_raises(ses.format(t), "ValueError",
                                     rf"^threads {t}: must be between 0 \(the default\) and 1024")
        self.assert_child_raises("treeattn.decode_partial(np.zeros((1, 1, 2, 64), np.float32), "
                                 "np.zeros((1, 1, 8, 64), np.float32), "
                                 "np.zeros((1, 1, 8, 64), np.float32), threads=1.5)",
                                 "TypeError", r"^threads must be an int, got float$")

    def test_thread_counts_in_range_work(self):
        rng = np.random.default_rng(1)
        q = rng.standard_normal((1, 1, 2, 64), dtype=np.float32)
        k = rng.standard_normal((1, 1, 8, 64), dtype=np.float32)
        one = treeattn.decode_partial(q, k, k, threads=1)
        np.testing.assert_array_equal(one, treeattn.decode_partial(q, k, k, threads=3))
        np.testing.assert_array_equal(one, treeattn.decode_partial(q, k, k, threads=0))

    # ---- item 2: a communicator that is not one --------------------------------------------------
    def test_session_without_a_communicator(self):
        for comm in ("None", "0", "'world'", "treeattn.local_world(1)"):
            self.assert_child_raises(
                f"treeattn.Session({comm}, heads=4, kv_heads=2, head_dim=64)", "TypeError",
                r"comm must be a treeattn\.Comm \(from treeattn\.local_world, treeattn\.run_local "
                r"or treeattn\.mpi_comm\), got ")

    def test_instances_that_were_never_initialized(self):
        # Session.__new__ / Comm.__new__ make instances whose C++ object holds nothing.
        for code, pattern in (
                ("treeattn.Session.__new__(treeattn.Session).rank", "never initialized"),
                ("treeattn.Session.__new__(treeattn.Session).extend(1)", "never initialized"),
                ("treeattn.Comm.__new__(treeattn.Comm).size", "holds no communicator"),
                ("treeattn.Session(treeattn.Comm.__new__(treeattn.Comm), heads=4, kv_heads=2, "
                 "head_dim=64)", "^comm holds no communicator")):
            self.assert_child_raises(code, "TypeError", pattern)

    # ---- item 3: arrays whose float32 copy cannot be made ----------------------------------------
    def test_huge_broadcast_views_raise_memory_error(self):
        # The reproduction: a 40 TiB copy, refused because it exceeds this machine's
        # memory (checked before the copy, so the result does not depend on overcommit).
        huge = "s = np.broadcast_to(np.zeros((1, 10), np.float32), (2**40, 10))\n"
        for call, arg in (("treeattn.merge_states(s, s)", "a"),
                          ("treeattn.normalize(s)", "states")):
            self.assert_child_raises(huge + call, "MemoryError",
                                     rf"^{arg}: cannot copy a non-contiguous \(1099511627776, 10\) "
                                     r"float32 array \(43980465111040 bytes\) into a contiguous "
                                     r"one: ")
        q = ("k = np.zeros((1, 1, 8, 64), np.float32)\n"
             "q = np.broadcast_to(np.zeros((1, 1, 1, 64), np.float32), (1, 2**34, 2, 64))\n")
        self.assert_child_raises(q + "treeattn.decode_partial(q, k, k)", "MemoryError",
                                 r"^q: cannot copy")
        self.assert_child_raises(q + "treeattn.oracle(q, k, k)", "MemoryError", r"^q: cannot copy")
        session = SESSION + ("s = treeattn.Session(c, heads=2**30, kv_heads=2, head_dim=64, "
                             "dtype='f32', context=4)\n"
                             "q = np.broadcast_to(np.zeros((1, 1, 1, 64), np.float32), "
                             "(1, 1, 2**30, 64))\n")
        self.assert_child_raises(session + "s.attend(0, q)", "MemoryError", r"^q: cannot copy")
        self.assert_child_raises(session + "s.attend_states(0, q)", "MemoryError",
                                 r"^q: cannot copy")

    def test_wrong_shape_is_refused_before_any_copy(self):
        # A huge view of the wrong shape is a shape error, not an attempt to copy it.
        huge = "s = np.broadcast_to(np.zeros((1, 1, 1, 64), np.float32), (2**40, 1, 4, 64))\n"
        ses = SESSION + "t = treeattn.Session(c, heads=4, kv_heads=2, head_dim=64, dtype='f32')\n"
        self.assert_child_raises(huge + ses + "t.attend(0, s)", "ValueError",
                                 r"^q must have shape \(1, 1, 4, 64\) .* got \(1099511627776, ")
        self.assert_child_raises(huge + ses + "t.append(s, s)", "ValueError",
                                 r"^k must have shape \(1, 1, 2, 64\) .* got \(1099511627776, ")
        self.assert_child_raises(huge + "treeattn.merge_states(s[:1], s)", "ValueError",
                                 r"^merge_states: a \(1, 1, 4, 64\) and b \(1099511627776, 1, 4, "
                                 r"64\) differ in shape$")

    # ---- item 4: extend by more tokens than can ever fit -----------------------------------------
    def test_extend_beyond_memory_is_refused_at_once(self):
        for n in ("2**62", "2**40", "2**63 - 1"):
            t0 = time.monotonic()
            self.assert_child_raises(
                SESSION + "s = treeattn.Session(c, heads=4, kv_heads=2, head_dim=64, context=16)\n"
                f"s.extend({n})", "OutOfMemoryError",
                r"^rank 0: extend: \d+ more tokens per row would put at least [\d.e+]+ bytes of "
                r"K and V on one rank", timeout=30)
            self.assertLess(time.monotonic() - t0, 20, n)
        # The same check on a striped session of 3 ranks (each rank holds a third of the tokens).
        code = """
            def body(c):
                s = treeattn.Session(c, heads=4, kv_heads=2, head_dim=64, context=16,
                                     placement="striped")
                try:
                    s.extend(2**62)
                except treeattn.OutOfMemoryError as e:
                    return str(e)
            msgs = treeattn.run_local(3, body)
            assert all("extend:" in m for m in msgs), msgs
            raise treeattn.OutOfMemoryError(msgs[2])
        """
        self.assert_child_raises(code, "OutOfMemoryError", r"^rank 2: extend: ", timeout=30)

    def test_a_failed_growth_leaves_no_half_grown_session(self):
        # An allocation that fails below the bound extend checks (here: 0.5 GiB of address space
        # left, a 1 GiB shard asked for) used to leave the session counting tokens its shards
        # had no room for; the next attend read past them and crashed. The session now puts its
        # placement back when a shard cannot grow: the error is OutOfMemoryError, the lengths
        # are those from before, and the session goes on working.
        code = """
            import resource
            vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                      if l.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), vm + (2 << 30)))
            hog = np.empty(3 << 29, np.uint8)  # 1.5 GiB of address space, never touched
            c = treeattn.local_world(1)[0]
            s = treeattn.Session(c, heads=4, kv_heads=1, head_dim=64, dtype="f32",
                                 context=CONTEXT)
            try:
                s.extend(1 << 21)  # 2**21 tokens of 512 bytes
                raise AssertionError("extend(2**21) did not fail")
            except treeattn.OutOfMemoryError:
                pass
            assert s.length(0) == CONTEXT, s.length(0)
            s.extend(2)
            out = s.attend(0, np.zeros((1, 1, 4, 64), np.float32))
            raise ValueError("usable after the failed growth")
        """
        for context in (0, 4):
            self.assert_child_raises(code.replace("CONTEXT", str(context)), "ValueError",
                                     r"^usable after the failed growth$")

    def test_extend_still_grows_and_refuses_negative(self):
        c = treeattn.local_world(1)[0]
        s = treeattn.Session(c, heads=4, kv_heads=2, head_dim=64, context=16)
        s.extend(1000)
        self.assertEqual(s.length(0), 1016)
        with self.assertRaisesRegex(ValueError, "n must be >= 0"):
            s.extend(-1)

    # ---- item 5: out, explicit_len, holder, timeout, integer lists -------------------------------
    def test_merge_states_out_must_be_float32(self):
        a = np.zeros((2, 66), np.float32)
        for out, why in ((np.zeros(a.shape), "float64"),
                         (np.zeros((2, 132), np.float32)[:, ::2], "not C-contiguous"),
                         (np.broadcast_to(np.zeros(66, np.float32), a.shape), "read-only"),
                         ([[0.0] * 66] * 2, "list")):
            with self.assertRaisesRegex(TypeError, r"^merge_states: out must be a writeable "
                                        r"C-contiguous float32 numpy array", msg=why):
                treeattn.merge_states(a, a, out=out)
        out = np.full(a.shape, 7, np.float32)
        self.assertIs(treeattn.merge_states(a, a, out=out), out)
        np.testing.assert_array_equal(out, a)

    def test_session_integer_arguments_are_checked(self):
        def session(**kw):
            # Only rank 0 calls: a check that let the call through would time out quickly.
            c = treeattn.local_world(2)
            kw.setdefault("timeout", 0.5)
            return treeattn.Session(c[0], heads=4, kv_heads=2, head_dim=64, context=16,
                                    check_agreement=False, **kw)
        with self.assertRaisesRegex(ValueError, r"^explicit_len\[0\] is -5: explicit shard "
                                    r"lengths must be >= 0$"):
            session(placement="explicit", explicit_len=[-5, 3])
        with self.assertRaisesRegex(ValueError, r"^holder 9 is outside the ranks \[0, 2\) of "
                                    r"comm$"):
            session(holder=9)
        with self.assertRaisesRegex(ValueError, r"^holder -1 is outside"):
            session(placement="single", holder=-1)
        for t in ("nan", "inf", "-1", "1e300"):
            with self.assertRaisesRegex(ValueError, r"^timeout must be a number of seconds in "
                                        r"\[0, 1e9\] \(0 waits forever\), got "
                                        + re.escape(repr(float(t))) + "$"):
                session(timeout=float(t))
        with self.assertRaisesRegex(TypeError, r"^explicit_len must be a sequence of ints, got "
                                    r"str"):
            session(placement="explicit", explicit_len="abc")
        with self.assertRaisesRegex(TypeError, r"^context must be an int or a sequence of ints "
                                    r"\(one per batch row\), got float"):
            treeattn.Session(treeattn.local_world(1)[0], heads=4, kv_heads=2, head_dim=64,
                             context=1.5)
        with self.assertRaisesRegex(TypeError, r"^node_of_rank\[1\] must be an int, got str"):
            session(node_of_rank=[0, "x"])

    def test_kv_row_arguments_give_clear_messages(self):
        q = np.zeros((1, 1, 2, 64), np.float32)
        k = np.zeros((1, 1, 8, 64), np.float32)
        for name in ("lengths", "pos_start", "total_len"):
            with self.assertRaisesRegex(TypeError, rf"^{name} must be an int or a sequence of "
                                        r"ints \(one per batch row\), got str$"):
                treeattn.decode_partial(q, k, k, **{name: "abc"})
            with self.assertRaisesRegex(TypeError, rf"^{name}\[0\] must be an int, got float$"):
                treeattn.oracle(q, k, k, **{name: [1.5]})
            with self.assertRaisesRegex(ValueError, rf"^{name}: {2**70} does not fit in 64 bits"):
                treeattn.decode_partial(q, k, k, **{name: 2**70})
        # numpy integers and integer arrays are ints.
        a = treeattn.decode_partial(q, k, k, lengths=np.int64(5))
        b = treeattn.decode_partial(q, k, k, lengths=np.array([5]))
        np.testing.assert_array_equal(a, b)


if __name__ == "__main__":
    unittest.main()
