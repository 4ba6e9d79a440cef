"""The decode session over mpi4py, run under mpirun (ctest: 2 and 4 ranks): every strategy and
placement against float64 numpy with bit-identical results on every rank, a session on a split
sub-communicator, and the errors (with the C++ messages) ranks get for bad calls.

    PYTHONPATH=<build>/python mpirun -np 4 python3 python/tests/test_session_mpi.py
"""

import io
import os
import sys
import unittest

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import treeattn  # noqa: E402
from session_case import run_case  # noqa: E402

TOL = 1e-5
WORLD = MPI.COMM_WORLD


class SessionMpiTest(unittest.TestCase):
    def check_case(self, comm, mpi_comm, **kw):
        worst, digest, delivered = run_case(comm, **kw)
        self.assertLessEqual(worst, TOL, f"rank {WORLD.Get_rank()}: {kw}")
        digests = mpi_comm.allgather(digest)
        self.assertEqual(len(set(digests)), 1, f"results differ between ranks: {kw}")
        return delivered

    def test_every_strategy_and_placement(self):
        comm = treeattn.mpi_comm()
        self.assertEqual((comm.rank, comm.size, comm.backend),
                         (WORLD.Get_rank(), WORLD.Get_size(), "mpi"))
        for strategy, _ in comm.strategies():
            for placement in ("even", "uneven", "striped"):
                if comm.strategy_info(strategy)["placement"] == "all-on-root" and placement != "even":
                    continue
                self.check_case(comm, WORLD, strategy=strategy, placement=placement)
        for dtype in ("bf16", "f16"):
            self.check_case(comm, WORLD, dtype=dtype, heads=8, kv_heads=2, head_dim=128,
                            context=(300, 41))

    def test_root_and_sub_communicator(self):
        # Ranks split into two halves; each half runs its own session on a duplicate of its half.
        sub = WORLD.Split(color=WORLD.Get_rank() % 2, key=WORLD.Get_rank())
        comm = treeattn.mpi_comm(sub)
        self.assertEqual((comm.rank, comm.size), (sub.Get_rank(), sub.Get_size()))
        delivered = run_case(comm, strategy="gather-root", root=0, seed=sub.Get_rank())[2]
        self.assertEqual(delivered, 6 if sub.Get_rank() == 0 else 0)
        self.check_case(comm, sub, strategy="tree", placement="striped", seed=3)
        del comm
        sub.Free()

    def test_errors(self):
        comm = treeattn.mpi_comm()
        r, p = comm.rank, comm.size
        # Ranks that disagree on the shape all get the same MismatchError.
        with self.assertRaises(treeattn.MismatchError) as cm:
            treeattn.Session(comm, heads=2, kv_heads=1, head_dim=64 if r == 0 else 128)
        # The odd rank out (rank 0) is named against the majority; two ranks are a tie, judged
        # against the lower rank.
        want = (f"rank {r}: ranks disagree on the run at setup: rank 1 has head_dim=128, rank 0 "
                f"has head_dim=64 (ranks differing from the majority: 0;") if p > 2 else (
                f"rank {r}: ranks disagree on the run at setup: rank 0 has head_dim=64, rank 1 "
                f"has head_dim=128 (ranks differing from rank 0's configuration: 1;")
        self.assertTrue(str(cm.exception).startswith(want), str(cm.exception))
        # A position of another rank.
        s = treeattn.Session(comm, heads=2, kv_heads=1, head_dim=64, dtype="f32", context=10 * p)
        kv = np.zeros((1, 64), np.float32)
        other = (r + 1) % p
        pos = int(s.owned_positions(0, other)[0])
        with self.assertRaises(ValueError) as cm:
            s.store(0, 0, pos, kv, kv)
        self.assertEqual(str(cm.exception), f"rank {r}: store: position {pos} of row 0 belongs to "
                                            f"rank {other} (even p={p} N=[{10 * p}])")
        # Not a communicator.
        null = MPI.COMM_NULL.py2f()
        with self.assertRaisesRegex(ValueError, f"^MPI communicator handle {null} is MPI_COMM_NULL"):
            treeattn.mpi_comm(MPI.COMM_NULL)


if __name__ == "__main__":
    # Rank 0 reports; the other ranks print their report only when they failed.
    me = WORLD.Get_rank()
    stream = sys.stderr if me == 0 else io.StringIO()
    runner = unittest.TextTestRunner(stream=stream, verbosity=2 if me == 0 else 1)
    result = unittest.main(exit=False, testRunner=runner).result
    if me != 0 and not result.wasSuccessful():
        sys.stderr.write(f"== rank {me} ==\n" + stream.getvalue())
    ok = WORLD.allreduce(int(result.wasSuccessful()), op=MPI.MIN)
    sys.exit(0 if ok else 1)
