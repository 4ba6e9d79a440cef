"""The decode session from Python over the in-process communicator (threads as ranks): every
strategy and placement at 1, 2, 3 and 5 ranks against float64 numpy, bit-identical results on
every rank, and the errors (with the C++ messages) of bad calls."""

import time
import unittest

import numpy as np

import treeattn
from session_case import run_case

TOL = 1e-5


class SessionLocalTest(unittest.TestCase):
    def run_all(self, p, **kw):
        results = treeattn.run_local(p, lambda comm: run_case(comm, **kw))
        for r, (worst, _, delivered) in enumerate(results):
            self.assertLessEqual(worst, TOL, f"rank {r} of {p}: {kw}")
        return results

    def test_every_strategy_and_placement(self):
        world = treeattn.local_world(1)[0]
        names = [n for n, _ in world.strategies()]
        self.assertIn("tree", names)
        self.assertIn("ring-kv", names)
        for p in (1, 2, 3, 5):
            for strategy in names:
                for placement in ("even", "uneven", "striped"):
                    own = world.strategy_info(strategy)["placement"] == "all-on-root"
                    if own and placement != "even":
                        continue  # single forces its own placement
                    res = self.run_all(p, strategy=strategy, placement=placement, seed=p)
                    digests = {d for _, d, _ in res}
                    self.assertEqual(len(digests), 1, f"{strategy} {placement} p={p}: ranks differ")
                    self.assertTrue(all(n == 2 * 3 for _, _, n in res))

    def test_auto_is_one_choice_on_every_rank(self):
        world = treeattn.local_world(1)[0]
        names = {n for n, _ in world.strategies()}
        for p in (1, 2, 3, 4, 8):
            def body(comm):
                s = treeattn.Session(comm, heads=8, kv_heads=2, head_dim=64, context=700,
                                     strategy="auto", threads=1)
                c = s.auto_choice
                return s.strategy, c["strategy"], c["ranking"][0][0], c["ranking"][0][1]
            res = treeattn.run_local(p, body)
            self.assertEqual(len(set(res)), 1, f"p={p}: ranks differ: {res}")
            strategy, chosen, first, latency = res[0]
            self.assertEqual((strategy, first), (chosen, chosen))
            self.assertIn(chosen, names)
            self.assertGreater(latency, 0.0)
            # The choice computes the exact attention like any named strategy.
            self.run_all(p, strategy="auto", seed=p)

    def test_auto_plans_on_the_given_topology(self):
        import json
        import os
        import tempfile
        preset = json.loads(treeattn.topology_json("emu-1gbit"))
        preset["name"] = "from-a-file"
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "topo.json")
            with open(path, "w") as f:
                json.dump(preset, f)
            for topo, name in (("emu-1gbit", "emu-1gbit"), ("preset:emu-veth", "emu-veth"),
                               (path, "from-a-file"), (dict(preset, name="a-dict"), "a-dict")):
                def body(comm):
                    s = treeattn.Session(comm, heads=8, kv_heads=2, head_dim=64, context=700,
                                         strategy="auto", threads=1, topology=topo)
                    c = s.auto_choice
                    return s.strategy, c["topology"], tuple(r[0] for r in c["ranking"])
                res = treeattn.run_local(2, body)
                self.assertEqual(len(set(res)), 1, f"{topo!r}: ranks differ: {res}")
                strategy, planned_on, ranking = res[0]
                self.assertEqual(planned_on, name)
                self.assertEqual(strategy, ranking[0])
        # Without topology= the job itself is planned on (not a preset's name).
        s = treeattn.Session(treeattn.local_world(1)[0], heads=8, kv_heads=2, head_dim=64,
                             context=700, strategy="auto", threads=1)
        self.assertNotIn(s.auto_choice["topology"], ("emu-1gbit", "emu-veth"))
        for bad, err in (("no-such-preset-or-file", ValueError), (3, TypeError)):
            with self.assertRaises(err):
                treeattn.Session(treeattn.local_world(1)[0], heads=8, kv_heads=2, head_dim=64,
                                 strategy="auto", topology=bad)

    def test_dtypes_shapes_and_q_len(self):
        for dtype in ("bf16", "f16", "f32"):
            self.run_all(3, dtype=dtype, seed=11)
        self.run_all(2, heads=8, kv_heads=1, head_dim=128, q_len=1, layers=1, context=(200, 3))
        self.run_all(4, heads=6, kv_heads=3, head_dim=80, q_len=4, context=(9, 0), steps=5)

    def test_root_delivers_to_one_rank(self):
        res = self.run_all(3, strategy="gather-root", root=1)
        self.assertEqual([n for _, _, n in res], [0, 6, 0])

    def test_session_properties(self):
        def body(comm):
            s = treeattn.Session(comm, batch=2, heads=4, kv_heads=2, head_dim=64, dtype="f16",
                                 layers=3, placement="striped", context=[10, 7])
            return (s.rank, s.size, s.layers, s.dtype, s.strategy, s.plan, s.pos_stride,
                    list(s.shard_lengths()), list(s.owned_positions(0)), s.live_kv_bytes)
        res = treeattn.run_local(2, body)
        self.assertEqual(res[0][:7], (0, 2, 3, "f16", "tree", "striped p=2 N=[10,7]", 2))
        self.assertEqual(res[0][7:9], ([5, 4], [0, 2, 4, 6, 8]))
        self.assertEqual(res[1][7:9], ([5, 3], [1, 3, 5, 7, 9]))
        self.assertEqual(res[0][9], 3 * (5 + 4) * 2 * 64 * 2 * 2)  # layers*tokens*Hkv*D*2B*(K,V)


class SessionErrorsTest(unittest.TestCase):
    def test_store_on_a_position_of_another_rank(self):
        def body(comm):
            s = treeattn.Session(comm, heads=2, kv_heads=1, head_dim=64, dtype="f32", context=10)
            kv = np.zeros((1, 64), np.float32)
            other = 9 if comm.rank == 0 else 0
            with self.assertRaises(ValueError) as cm:
                s.store(0, 0, other, kv, kv)
            return str(cm.exception)
        msgs = treeattn.run_local(2, body)
        self.assertEqual(msgs[0], "rank 0: store: position 9 of row 0 belongs to rank 1 (even p=2 N=[10])")
        self.assertEqual(msgs[1], "rank 1: store: position 0 of row 0 belongs to rank 0 (even p=2 N=[10])")

    def test_ranks_that_disagree_get_the_same_mismatch(self):
        def body(comm):
            with self.assertRaises(treeattn.MismatchError) as cm:
                treeattn.Session(comm, heads=2, kv_heads=1, head_dim=64 if comm.rank == 0 else 128)
            return str(cm.exception)
        msgs = treeattn.run_local(3, body)
        for r, m in enumerate(msgs):
            # The odd rank out is named against the majority.
            self.assertTrue(m.startswith(f"rank {r}: ranks disagree on the run at setup: rank 1 has "
                                         "head_dim=128, rank 0 has head_dim=64 (ranks differing "
                                         "from the majority: 0;"), m)

    def test_bad_configuration_raises_on_every_rank(self):
        def body(comm):
            with self.assertRaises(treeattn.InvalidArgumentError) as cm:
                treeattn.Session(comm, heads=2, kv_heads=1, head_dim=64, strategy="nope")
            return str(cm.exception)
        msgs = treeattn.run_local(2, body)
        for r, m in enumerate(msgs):
            self.assertRegex(m, f"^rank {r}: rank 0 rejected the run configuration at setup: .*nope")
        def bad_dim(comm):
            with self.assertRaises(treeattn.InvalidArgumentError) as cm:
                treeattn.Session(comm, heads=2, kv_heads=1, head_dim=59)
            return str(cm.exception)
        self.assertEqual(treeattn.run_local(1, bad_dim)[0],
                         "rank 0: unsupported: head_dim 59 is not supported "
                         "(supported: 64, 80, 96, 128, 192, 256)")

    def test_bad_arrays(self):
        def body(comm):
            s = treeattn.Session(comm, batch=2, heads=4, kv_heads=2, head_dim=64, layers=2,
                                 context=4)
            with self.assertRaisesRegex(ValueError, r"^q must have shape \(2, 1, 4, 64\) "
                                        r"\[batch, q_len, heads, head_dim\], got \(2, 1, 2, 64\)$"):
                s.attend(0, np.zeros((2, 1, 2, 64), np.float32))
            with self.assertRaisesRegex(TypeError, "q must have dtype float32"):
                s.attend(0, np.zeros((2, 1, 4, 64)))
            with self.assertRaisesRegex(ValueError, r"k must have shape \(2, 2, 2, 64\)"):
                s.append(np.zeros((1, 2, 2, 64), np.float32), np.zeros((1, 2, 2, 64), np.float32))
            with self.assertRaisesRegex(ValueError, f"^rank {comm.rank}: attend: layer 2 is outside "
                                        r"\[0, 2\)$"):
                s.attend(2, np.zeros((2, 1, 4, 64), np.float32))
            return True
        self.assertEqual(treeattn.run_local(2, body), [True, True])

    def test_a_rank_that_never_arrives_is_named(self):
        def body(comm):
            s = treeattn.Session(comm, heads=2, kv_heads=1, head_dim=64, dtype="f32", context=4,
                                 timeout=0.3)
            if comm.rank == 1:
                time.sleep(1.0)  # holds its communicator but never attends
                return None
            t0 = time.monotonic()
            with self.assertRaises(treeattn.PeerTimeoutError) as cm:
                s.attend(0, np.zeros((1, 1, 2, 64), np.float32))
            return str(cm.exception), time.monotonic() - t0
        msg, waited = treeattn.run_local(2, body)[0]
        self.assertRegex(msg, r"^rank 0: timed out after \d+ ms in .*rank 1 never arrived")
        self.assertLess(waited, 0.9)

    def test_run_local_reraises_the_failing_rank(self):
        def body(comm):
            if comm.rank == 1:
                raise KeyError("rank 1 fails first")
            s = treeattn.Session(comm, heads=2, kv_heads=1, head_dim=64, timeout=5)
            return s
        t0 = time.monotonic()
        with self.assertRaises(KeyError):
            treeattn.run_local(2, body)
        self.assertLess(time.monotonic() - t0, 4.0, "rank 0 must fail when rank 1 leaves")


if __name__ == "__main__":
    unittest.main()
