"""treeattn: exact attention decoding when one context is spread over many ranks.

The Python face of the C++ library (the extension ``treeattn._treeattn``, built with pybind11,
which Debian 12 packages; nanobind is not packaged there). numpy arrays in and out:

  decode_partial(q, k, v)  partial softmax states [B, Q, H, D + 2] of q against one KV shard
  merge_states(a, b)       the merged states of two disjoint shards
  normalize(states)        (out, lse) of state records
  oracle(q, k, v)          the float64 reference (out, lse)
  Session(comm, ...)       the decode session: this rank's KV shards of every layer, merged
                           across ranks by a strategy ("tree", "ring-kv", ...); with
                           rows_start_free=True its rows are sequence slots that join
                           (add_sequence), grow (extend(n, seq=...), store_range) and leave
                           (remove_sequence), attended together by attend(layer, q, seqs=...);
                           strategy="auto": the planner's choice on topology= (a preset name,
                           a topology file's path or its dict; default: this job)
  topology_json(t)         a preset's or file's topology as the file's JSON text

Communicators: ``mpi_comm(mpi4py_comm)`` wraps an mpi4py communicator (default COMM_WORLD);
``local_world(p)`` makes p in-process ranks for p threads, and ``run_local(p, fn)`` runs
``fn(comm)`` on p threads with them.

Errors: every non-ok C++ Status raises a ``treeattn.Error`` whose text is the C++ message:
``InvalidArgumentError`` (a ValueError) or a RuntimeError subclass (``UnsupportedError``,
``MismatchError``, ``PeerTimeoutError``, ``NumericsError``, ``InternalError``,
``OutOfMemoryError``); ``.code`` holds the code's name. A wrong dtype raises TypeError: inputs
are never converted silently (see _treeattn.cpp for when arrays are read in place). Arguments of
the wrong kind (None for a communicator, a str for lengths) raise TypeError naming the argument,
and a copy larger than the memory the process can have (a huge broadcast view) MemoryError.
"""

import threading
import traceback

from . import _treeattn
from ._treeattn import (  # noqa: F401  (re-exported)
    Comm,
    Error,
    InternalError,
    InvalidArgumentError,
    MismatchError,
    NumericsError,
    OutOfMemoryError,
    PeerTimeoutError,
    Session,
    UnsupportedError,
    best_isa,
    decode_partial,
    has_mpi,
    local_world,
    merge_states,
    normalize,
    oracle,
    supported_head_dims,
    topology_json,
)

__all__ = [
    "Comm", "Error", "InternalError", "InvalidArgumentError", "MismatchError", "NumericsError",
    "OutOfMemoryError", "PeerTimeoutError", "Session", "UnsupportedError", "best_isa",
    "decode_partial", "has_mpi", "local_world", "merge_states", "mpi_comm", "normalize", "oracle",
    "run_local", "supported_head_dims", "topology_json",
]


def mpi_comm(comm=None):
    """A treeattn Comm over an mpi4py intracommunicator (default MPI.COMM_WORLD).

    treeattn duplicates it (MPI_Comm_dup), so its traffic never mixes with the caller's; the
    mpi4py communicator must stay alive and MPI initialized while the Comm is used.
    """
    if not has_mpi:
        raise UnsupportedError("this treeattn module was built without MPI (TREEATTN_WITH_MPI=OFF)")
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    if not callable(getattr(comm, "py2f", None)):
        raise TypeError(f"comm must be an mpi4py communicator, got {type(comm).__name__}")
    return _treeattn._mpi_comm_from_fortran(comm.py2f())


def run_local(size, fn, node_of_rank=None):
    """Runs fn(comm) on `size` threads, thread r with rank r of one in-process world.

    Returns the list of the ranks' return values. If any rank raised, re-raises the exception
    raised first (in time) that is not a PeerTimeoutError, else the first one: a rank that fails
    makes its peers fail or time out after it. Each thread drops its communicator when fn
    returns or raises, so peers still waiting on it fail at once instead of hanging (unless fn's
    return value keeps it alive).
    """
    comms = local_world(size, node_of_rank)
    results = [None] * size
    errors = []  # in the order they were raised
    lock = threading.Lock()

    def body(r):
        comm = comms[r]
        comms[r] = None
        try:
            results[r] = fn(comm)
        except BaseException as e:  # noqa: B036  (re-raised on the calling thread)
            # The traceback's frames would keep fn's `comm` (and its sessions) alive; clear their
            # locals so the communicator goes now and peers waiting on it fail at once.
            traceback.clear_frames(e.__traceback__)
            with lock:
                errors.append(e)
        finally:
            del comm

    threads = [threading.Thread(target=body, args=(r,), name=f"treeattn-rank-{r}")
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        own = [e for e in errors if not isinstance(e, PeerTimeoutError)]
        raise (own or errors)[0]
    return results
