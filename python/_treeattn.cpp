// The Python extension `treeattn._treeattn`: numpy bindings of the kernel, the state algebra, the
// float64 oracle and the decode session (over mpi4py or the in-process communicator).
//
// Why pybind11: it is packaged in Debian 12 (pybind11-dev, python3-pybind11), so the module
// builds from apt packages like the rest of treeattn; nanobind is not packaged there.
//
// Arrays and copies:
//   - Every float input must already have dtype float32 (K/V: float32, float16, or uint16 holding
//     bfloat16 bits with dtype="bf16"); anything else raises TypeError instead of silently
//     converting a possibly huge array.
//   - K and V are never copied: any strides work as long as the last axis (head_dim) is
//     contiguous and K and V have the same strides (a slice of a larger cache is a view);
//     otherwise ValueError tells the caller to pass np.ascontiguousarray.
//   - q, states and the K/V given to Session.store/store_range/append are read in place when
//     C-contiguous and copied otherwise (they are one step's worth of data). Shapes are checked
//     before any copy; a copy larger than the memory this process can have (a broadcast view can
//     describe terabytes) raises MemoryError naming the argument.
//   - Outputs are numpy arrays the C++ code writes into directly.
//
// Errors: a non-ok treeattn::Status raises treeattn.Error with exactly Status::message() as its
// text and the code name in .code: InvalidArgumentError (also a ValueError) for
// kInvalidArgument, and RuntimeError subclasses for the others (UnsupportedError, MismatchError,
// PeerTimeoutError, NumericsError, InternalError, OutOfMemoryError). Checks this file makes
// itself on shapes and values raise InvalidArgumentError too; wrong dtypes and arguments of the
// wrong kind (None for comm, a str for lengths) raise TypeError naming the argument. threads is
// 0 (the default) or 1..1024 everywhere. A session whose extend or append failed after placing
// the new tokens (an allocation that failed) raises InternalError on every later call.
//
// The GIL is released during every call that computes or communicates, so several Python
// threads can each drive one rank of the in-process communicator (treeattn.run_local).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "treeattn/comm.hpp"
#include "treeattn/comm_local.hpp"
#include "treeattn/kernel.hpp"
#include "treeattn/measure.hpp"
#include "treeattn/oracle.hpp"
#include "treeattn/session.hpp"
#include "treeattn/shape.hpp"
#include "treeattn/state.hpp"
#include "treeattn/status.hpp"
#include "treeattn/strategy.hpp"
#include "treeattn/topology.hpp"
#if defined(TREEATTN_PY_WITH_MPI)
#include "treeattn/comm_mpi.hpp"
#endif

namespace py = pybind11;

namespace treeattn::python {
namespace {

// ---- errors ------------------------------------------------------------------------------------

// A non-ok Status on its way to Python (translated in the module's exception translator).
class StatusError : public std::exception {
 public:
  explicit StatusError(Status s) : status_(std::move(s)) {}
  const char* what() const noexcept override { return status_.message().c_str(); }
  const Status& status() const { return status_; }

 private:
  Status status_;
};

void check(const Status& s) {
  if (!s.is_ok()) throw StatusError(s);
}
template <class T>
T unwrap(Result<T>&& r) {
  if (!r.is_ok()) throw StatusError(r.status());
  return std::move(r).value();
}
[[noreturn]] void invalid(const std::string& message) {
  throw StatusError(invalid_argument(message));
}

// Python exception types by Code (index = static_cast<int>(code)); owned by the module.
constexpr int kCodes = static_cast<int>(Code::kOutOfMemory) + 1;
std::array<PyObject*, kCodes> g_errors{};

void set_python_error(const Status& s) {
  PyObject* type = g_errors[static_cast<std::size_t>(s.code())];
  if (type == nullptr) type = g_errors[static_cast<std::size_t>(Code::kInternal)];
  py::object inst = py::reinterpret_borrow<py::object>(type)(s.message());
  inst.attr("code") = py::str(code_name(s.code()));
  PyErr_SetObject(type, inst.ptr());
}

// Creates treeattn.<name> deriving from the given bases and adds it to the module.
PyObject* make_error(py::module_& m, const char* name, py::tuple bases, const char* doc) {
  const std::string full = std::string("treeattn.") + name;
  PyObject* t = PyErr_NewExceptionWithDoc(full.c_str(), doc, bases.ptr(), nullptr);
  if (t == nullptr) throw py::error_already_set();
  m.add_object(name, py::reinterpret_borrow<py::object>(t));
  return t;  // the module keeps a reference for the lifetime of the interpreter
}

// ---- integers ---------------------------------------------------------------------------------

// The type name Python shows for o ("NoneType", "str", "numpy.ndarray").
std::string type_name(const py::handle& o) { return Py_TYPE(o.ptr())->tp_name; }

// Whether o is one int: a Python int, a numpy integer or a 0-D integer array (an array of more
// dimensions has __index__ too, but is a sequence here).
bool is_int(const py::handle& o) {
  if (py::isinstance<py::array>(o)) return py::reinterpret_borrow<py::array>(o).ndim() == 0;
  return PyIndex_Check(o.ptr());
}

// An int64 from a Python int or anything with __index__ (numpy integers), with messages that
// name the argument instead of pybind11's generic "Unable to cast Python instance".
int64_t to_int64(const py::handle& o, const std::string& what) {
  py::object i;
  if (PyIndex_Check(o.ptr())) i = py::reinterpret_steal<py::object>(PyNumber_Index(o.ptr()));
  if (!i) {
    PyErr_Clear();  // a float array's __index__ refuses
    throw py::type_error(what + " must be an int, got " + type_name(o));
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow != 0) invalid(what + ": " + std::string(py::str(i)) + " does not fit in 64 bits");
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// A list of int64 from a sequence of ints (a list, a tuple, an integer numpy array; not a str).
// At most max_count values are read: a longer sequence is refused before it is walked, so a
// range(2**60) fails at once.
std::vector<int64_t> to_int64_list(const py::handle& o, const std::string& what,
                                   const std::string& expected, std::size_t max_count) {
  const bool text = PyUnicode_Check(o.ptr()) || PyBytes_Check(o.ptr());
  if (text || !PySequence_Check(o.ptr()))
    throw py::type_error(what + " must be " + expected + ", got " + type_name(o));
  const Py_ssize_t n = PySequence_Size(o.ptr());
  if (n < 0) throw py::error_already_set();
  if (static_cast<std::size_t>(n) > max_count)
    invalid(what + " has " + std::to_string(n) + " values, more than the " +
            std::to_string(max_count) + " it can use");
  std::vector<int64_t> out;
  out.reserve(static_cast<std::size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    py::object item = py::reinterpret_steal<py::object>(PySequence_GetItem(o.ptr(), i));
    if (!item) throw py::error_already_set();
    out.push_back(to_int64(item, what + "[" + std::to_string(i) + "]"));
  }
  return out;
}

// An int (given once for every entry) or a sequence of ints.
std::vector<int64_t> int_or_list(const py::handle& o, const std::string& what,
                                 std::size_t max_count) {
  if (is_int(o)) return {to_int64(o, what)};
  return to_int64_list(o, what, "an int or a sequence of ints (one per batch row)", max_count);
}

// The kernels' thread count: 0 (OpenMP's default) or 1..kMaxThreads (kernel.hpp), refused here,
// before any work, by the kernels' own check_thread_count and with its message, also for ints
// beyond 64 bits: a count in the hundred thousands makes the OpenMP runtime fail to create its
// team, which crashes the interpreter.
int thread_count(const py::handle& o) {
  py::object i;
  if (is_int(o)) i = py::reinterpret_steal<py::object>(PyNumber_Index(o.ptr()));
  if (!i) {
    PyErr_Clear();
    throw py::type_error("threads must be an int, got " + type_name(o));
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (v == -1 && overflow == 0 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow == 0) {
    check(check_thread_count(v));
    return static_cast<int>(v);
  }
  // Beyond 64 bits: the kernels' message with the number as Python writes it (their text after
  // the value is the same for every refused count, so -1's supplies it).
  const std::string kernel_text = check_thread_count(-1).message();
  const std::string tail = kernel_text.substr(kernel_text.find(':'));
  invalid("threads " + std::string(py::str(i)) + tail);
}

// ---- arrays ------------------------------------------------------------------------------------

using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

std::string shape_text(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// The memory this process can have in bytes: the machine's physical memory, or less under an
// address-space limit (ulimit -v); 0 when unknown. No copy or cache larger than it can be made,
// so such requests are refused before they are tried (the result then does not depend on the
// kernel's overcommit policy, which may grant the allocation and kill the process later).
uint64_t memory_limit() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  uint64_t limit =
      pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY &&
      (limit == 0 || as.rlim_cur < limit))
    limit = as.rlim_cur;
  return limit;
}

[[noreturn]] void memory_error(const std::string& message) {
  PyErr_SetString(PyExc_MemoryError, message.c_str());
  throw py::error_already_set();
}

// A float32 array in C order: the caller's buffer when it already is one, a copy when it is
// float32 with other strides. Other dtypes raise TypeError; a copy that cannot be made raises
// MemoryError naming the argument (a broadcast view can describe terabytes).
F32Array as_f32(const py::array& a, const char* what) {
  if (!a.dtype().is(py::dtype::of<float>()))
    throw py::type_error(std::string(what) + " must have dtype float32, got " +
                         std::string(py::str(a.dtype())) +
                         " (convert it with .astype(np.float32))");
  if (F32Array::check_(a)) return py::reinterpret_borrow<F32Array>(a);
  const auto bytes = static_cast<uint64_t>(a.size()) * sizeof(float);
  const std::string head = std::string(what) + ": cannot copy a non-contiguous " + shape_text(a) +
                           " float32 array (" + std::to_string(bytes) +
                           " bytes) into a contiguous one: ";
  const uint64_t memory = memory_limit();
  if (memory != 0 && bytes > memory)
    memory_error(head + "more than the memory this process can have (" + std::to_string(memory) +
                 " bytes)");
  try {
    return F32Array(py::reinterpret_borrow<py::object>(a));
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_MemoryError)) throw;
    memory_error(head + std::string(py::str(e.value())));
  }
}

// Whether a has exactly the shape want.
bool has_shape(const py::array& a, const std::vector<int64_t>& want) {
  if (a.ndim() != static_cast<py::ssize_t>(want.size())) return false;
  for (std::size_t i = 0; i < want.size(); ++i)
    if (a.shape(static_cast<py::ssize_t>(i)) != want[i]) return false;
  return true;
}

void expect_ndim(const py::array& a, py::ssize_t ndim, const char* what, const char* layout) {
  if (a.ndim() != ndim)
    invalid(std::string(what) + " must be " + std::to_string(ndim) + "-D " + layout +
            ", got shape " + shape_text(a));
}

// Per-batch-row int64 values from None (fallback), an int (every row) or a sequence of batch ints.
std::vector<int64_t> rows(const py::object& o, int64_t batch, const char* what,
                          const std::vector<int64_t>& fallback) {
  if (o.is_none()) return fallback;
  const auto count = static_cast<std::size_t>(batch);
  if (is_int(o)) return std::vector<int64_t>(count, to_int64(o, what));
  const bool text = PyUnicode_Check(o.ptr()) || PyBytes_Check(o.ptr());
  if (!text && PySequence_Check(o.ptr())) {
    const Py_ssize_t n = PySequence_Size(o.ptr());
    if (n < 0) throw py::error_already_set();
    if (static_cast<std::size_t>(n) != count)  // before walking it: it may be a huge range
      invalid(std::string(what) + " has " + std::to_string(n) + " values for batch " +
              std::to_string(batch) + " (give one int, or one per batch row)");
  }
  return to_int64_list(o, what, "an int or a sequence of ints (one per batch row)", count);
}

// K and V as a KVShard view over the caller's numpy memory, plus the per-row spans it points to.
struct KVArgs {
  py::array k, v;  // keep the buffers alive while the view is used
  std::vector<int64_t> len, pos_start, total_len;
  KVShard shard;
};

DType kv_dtype(const py::array& k, const std::optional<std::string>& name) {
  const bool f32 = k.dtype().is(py::dtype::of<float>());
  const bool f16 = k.dtype().is(py::dtype("float16"));
  const bool u16 = k.dtype().is(py::dtype::of<uint16_t>());
  const std::string got = py::str(k.dtype());
  if (!name) {
    if (f32) return DType::kF32;
    if (f16) return DType::kF16;
    if (u16)
      throw py::type_error("k has dtype uint16: pass dtype=\"bf16\" if it holds bfloat16 bits");
    throw py::type_error(
        "k and v must have dtype float32 or float16 (or uint16 with dtype=\"bf16\"), "
        "got " +
        got);
  }
  const auto t = parse_dtype(*name);
  if (!t) invalid("unknown KV dtype '" + *name + "' (known: f32, f16, bf16)");
  if (dtype_is_quantized(*t))
    check(
        unsupported("KV dtype " + std::string(dtype_name(*t)) +
                    " is not supported by the Python decode_partial/oracle (use f32, f16, bf16)"));
  const bool ok =
      (*t == DType::kF32 && f32) || (*t == DType::kF16 && f16) || (*t == DType::kBF16 && u16);
  if (!ok)
    throw py::type_error("dtype=\"" + std::string(dtype_name(*t)) +
                         "\" needs k and v of numpy dtype " +
                         (*t == DType::kF32   ? "float32"
                          : *t == DType::kF16 ? "float16"
                                              : "uint16") +
                         ", got " + got);
  return *t;
}

// k, v: [B, Hkv, N, D]. lengths (tokens per row, default N), pos_start (default 0), total_len
// (default: the position after the row's last token) and pos_stride as in KVShard (shape.hpp).
KVArgs kv_args(const py::array& k, const py::array& v, const std::optional<std::string>& dtype,
               const py::object& lengths, const py::object& pos_start, const py::object& total_len,
               int64_t pos_stride) {
  KVArgs a;
  a.k = k;
  a.v = v;
  expect_ndim(k, 4, "k", "[batch, kv_heads, tokens, head_dim]");
  expect_ndim(v, 4, "v", "[batch, kv_heads, tokens, head_dim]");
  for (py::ssize_t i = 0; i < 4; ++i)
    if (k.shape(i) != v.shape(i))
      invalid("k and v must have the same shape, got k " + shape_text(k) + " and v " +
              shape_text(v));
  const DType t = kv_dtype(k, dtype);
  if (!v.dtype().is(k.dtype()))
    throw py::type_error("k and v must have the same dtype, got " +
                         std::string(py::str(k.dtype())) + " and " +
                         std::string(py::str(v.dtype())));
  const auto item = static_cast<py::ssize_t>(dtype_size(t));
  const int64_t batch = k.shape(0), n = k.shape(2), d = k.shape(3);
  // Element strides; an axis of extent 1 is never stepped over, so its stride does not matter.
  const int64_t fallback[3] = {k.shape(1) * n * d, n * d, d};
  int64_t stride[3];
  for (py::ssize_t i = 0; i < 4; ++i) {
    const bool same = k.strides(i) == v.strides(i) || k.shape(i) == 1;
    const bool last_ok = i < 3 || k.strides(3) == item || d == 1;
    if (!same || !last_ok || k.strides(i) < 0 || k.strides(i) % item != 0)
      invalid(
          "k and v must share their strides, with head_dim contiguous and no negative strides "
          "(got k strides " +
          std::string(py::str(py::cast(std::vector<py::ssize_t>(k.strides(), k.strides() + 4)))) +
          ", v strides " +
          std::string(py::str(py::cast(std::vector<py::ssize_t>(v.strides(), v.strides() + 4)))) +
          "); pass np.ascontiguousarray(k) and np.ascontiguousarray(v)");
    if (i < 3) stride[i] = k.shape(i) == 1 ? fallback[i] : k.strides(i) / item;
  }
  a.len = rows(lengths, batch, "lengths", std::vector<int64_t>(static_cast<std::size_t>(batch), n));
  for (int64_t l : a.len)
    if (l > n)
      invalid("lengths: " + std::to_string(l) + " tokens in a row of k and v with " +
              std::to_string(n) + " token slots");
  a.pos_start =
      rows(pos_start, batch, "pos_start", std::vector<int64_t>(static_cast<std::size_t>(batch), 0));
  std::vector<int64_t> end(static_cast<std::size_t>(batch));
  for (std::size_t b = 0; b < end.size(); ++b)
    end[b] = a.len[b] > 0 ? a.pos_start[b] + (a.len[b] - 1) * pos_stride + 1 : a.pos_start[b];
  a.total_len = rows(total_len, batch, "total_len", end);
  KVShard& s = a.shard;
  s.dtype = t;
  s.k = k.data();
  s.v = v.data();
  s.stride_batch = stride[0];
  s.stride_head = stride[1];
  s.stride_token = stride[2];
  s.len = a.len;
  s.pos_start = a.pos_start;
  s.total_len = a.total_len;
  s.pos_stride = pos_stride;
  return a;
}

// The decode shape of q [B, Q, H, D] against k, v [B, Hkv, N, D]. Checked before q is copied and
// before kv_args sizes its per-row lists, so that a huge broadcast view fails on its shape.
AttnShape attn_shape(const py::array& q, const py::array& k, const py::array& v) {
  expect_ndim(k, 4, "k", "[batch, kv_heads, tokens, head_dim]");
  expect_ndim(v, 4, "v", "[batch, kv_heads, tokens, head_dim]");
  expect_ndim(q, 4, "q", "[batch, q_len, heads, head_dim]");
  if (q.shape(0) != k.shape(0) || q.shape(3) != k.shape(3))
    invalid("q " + shape_text(q) + " ([batch, q_len, heads, head_dim]) and k " + shape_text(k) +
            " ([batch, kv_heads, tokens, head_dim]) disagree on batch or head_dim");
  AttnShape s;
  s.batch = q.shape(0);
  s.q_len = q.shape(1);
  s.heads = q.shape(2);
  s.kv_heads = k.shape(1);
  s.head_dim = q.shape(3);
  check(s.validate());
  return s;
}

std::vector<py::ssize_t> dims(std::initializer_list<int64_t> l) {
  return std::vector<py::ssize_t>(l.begin(), l.end());
}

// ---- kernels, states, oracle -------------------------------------------------------------------

py::array_t<float> decode_partial_py(const py::array& q_in, const py::array& k, const py::array& v,
                                     std::optional<std::string> dtype, float scale,
                                     const py::object& lengths, const py::object& pos_start,
                                     const py::object& total_len, int64_t pos_stride,
                                     const py::object& threads, int64_t chunk_tokens,
                                     const std::string& isa) {
  const int thread_n = thread_count(threads);
  const AttnShape shape = attn_shape(q_in, k, v);
  F32Array q = as_f32(q_in, "q");
  KVArgs kv = kv_args(k, v, dtype, lengths, pos_start, total_len, pos_stride);
  DecodeOptions o;
  o.scale = scale;
  o.threads = thread_n;
  o.chunk_tokens = chunk_tokens;
  o.isa = unwrap(parse_isa(isa));
  py::array_t<float> states(dims({shape.batch, shape.q_len, shape.heads, shape.head_dim + 2}));
  float* out = states.mutable_data();
  const float* qp = q.data();
  {
    py::gil_scoped_release nogil;
    check(decode_partial(shape, qp, kv.shard, out, o));
  }
  return states;
}

py::tuple oracle_py(const py::array& q_in, const py::array& k, const py::array& v,
                    std::optional<std::string> dtype, double scale, const py::object& lengths,
                    const py::object& pos_start, const py::object& total_len, int64_t pos_stride) {
  const AttnShape shape = attn_shape(q_in, k, v);
  F32Array q = as_f32(q_in, "q");
  KVArgs kv = kv_args(k, v, dtype, lengths, pos_start, total_len, pos_stride);
  py::array_t<double> out(dims({shape.batch, shape.q_len, shape.heads, shape.head_dim}));
  py::array_t<double> lse(dims({shape.batch, shape.q_len, shape.heads}));
  double* op = out.mutable_data();
  double* lp = lse.mutable_data();
  const float* qp = q.data();
  {
    py::gil_scoped_release nogil;
    check(oracle_attention(shape, qp, kv.shard, op, lp, scale));
  }
  return py::make_tuple(out, lse);
}

// states [..., D + 2] float32 -> (number of records, D).
std::pair<std::size_t, std::size_t> records_of(const py::array& a, const char* what) {
  if (a.ndim() < 1 || a.shape(a.ndim() - 1) < 2)
    invalid(std::string(what) + " must be state records [..., head_dim + 2], got shape " +
            shape_text(a));
  const auto rec = static_cast<std::size_t>(a.shape(a.ndim() - 1));
  return {static_cast<std::size_t>(a.size()) / rec, rec - 2};
}

py::array_t<float> merge_states_py(const py::array& a_in, const py::array& b_in,
                                   const py::object& out_obj) {
  // Shapes and out first: no copy is made for a call that is refused anyway.
  records_of(a_in, "a");
  bool same = a_in.ndim() == b_in.ndim();
  for (py::ssize_t i = 0; same && i < a_in.ndim(); ++i) same = a_in.shape(i) == b_in.shape(i);
  if (!same)
    invalid("merge_states: a " + shape_text(a_in) + " and b " + shape_text(b_in) +
            " differ in shape");
  py::array_t<float> out;
  if (!out_obj.is_none()) {
    // Checked on the caller's object itself: assigning it to an array_t<float> would convert it
    // to a new float32 array and leave the caller's out untouched.
    const bool ok = py::isinstance<py::array>(out_obj) && [&] {
      const auto o = py::reinterpret_borrow<py::array>(out_obj);
      return o.dtype().is(py::dtype::of<float>()) && (o.flags() & py::array::c_style) &&
             o.writeable();
    }();
    if (!ok)
      throw py::type_error(
          "merge_states: out must be a writeable C-contiguous float32 numpy array, got " +
          (py::isinstance<py::array>(out_obj)
               ? std::string(py::str(py::reinterpret_borrow<py::array>(out_obj).dtype())) + " array"
               : type_name(out_obj)));
    out = py::reinterpret_borrow<py::array_t<float>>(out_obj);
    if (!has_shape(out, std::vector<int64_t>(a_in.shape(), a_in.shape() + a_in.ndim())))
      invalid("merge_states: out " + shape_text(out) + " must have the shape of a " +
              shape_text(a_in));
  }
  F32Array a = as_f32(a_in, "a");
  F32Array b = as_f32(b_in, "b");
  const auto [n, d] = records_of(a, "a");
  if (out_obj.is_none())
    out = py::array_t<float>(std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()));
  float* acc = out.mutable_data();
  // The merge is commutative bit for bit (state.hpp), so out may alias either input.
  const float* first = a.data();
  const float* second = b.data();
  if (acc == second) std::swap(first, second);
  const std::size_t floats = n * state_record_floats(d);
  if (acc != first) std::memcpy(acc, first, floats * sizeof(float));
  state_merge_n(acc, second, n, d);
  return out;
}

py::tuple normalize_py(const py::array& s_in) {
  records_of(s_in, "states");  // before any copy
  F32Array s = as_f32(s_in, "states");
  const auto [n, d] = records_of(s, "states");
  std::vector<py::ssize_t> lead(s.shape(), s.shape() + s.ndim() - 1);
  std::vector<py::ssize_t> full = lead;
  full.push_back(static_cast<py::ssize_t>(d));
  py::array_t<float> out(full), lse(lead);
  float* op = out.mutable_data();
  float* lp = lse.mutable_data();
  const float* rec = s.data();
  for (std::size_t i = 0; i < n; ++i)
    state_normalize(rec + i * state_record_floats(d), d, op + i * d, lp + i);
  return py::make_tuple(out, lse);
}

// The most ranks local_world makes (threads of one process).
constexpr int kMaxLocalRanks = 4096;

// ---- communicators and the session -------------------------------------------------------------

// Comm.__new__(Comm) and Session.__new__(Session) make instances whose __init__ never ran;
// pybind11 gives such an instance raw storage from the class's operator new the first time a
// method reads it. Zeroed storage reads as "no communicator" / "no session", which get() checks,
// instead of as garbage pointers.
struct ZeroedNew {
  static void* operator new(std::size_t n) {
    void* p = ::operator new(n);
    std::memset(p, 0, n);
    return p;
  }
  static void operator delete(void* p) { ::operator delete(p); }
};

// A Communicator owned by Python. An MPI communicator that outlives MPI (the interpreter shuts
// mpi4py down first) is leaked instead of freed: MPI calls after MPI_Finalize are erroneous.
struct PyComm : ZeroedNew {
  std::unique_ptr<Communicator> comm;
  bool mpi = false;
  // An instance made with Comm.__new__ holds no communicator.
  Communicator& get() const {
    if (!comm)
      throw py::type_error(
          "this Comm holds no communicator (make one with treeattn.local_world or "
          "treeattn.mpi_comm)");
    return *comm;
  }
  ~PyComm() {
#if defined(TREEATTN_PY_WITH_MPI)
    if (mpi && !mpi_active()) (void)comm.release();
#endif
  }
};

struct PySession : ZeroedNew {
  std::shared_ptr<PyComm> comm;  // the session's communicator lives at least as long
  std::unique_ptr<DecodeSession> s;
  ~PySession() {
#if defined(TREEATTN_PY_WITH_MPI)
    if (comm->mpi && !mpi_active()) (void)s.release();  // its strategies may own MPI objects
#endif
  }
  // Set when a call that grows the rows failed after placing the new tokens: the placement then
  // counts tokens the shards have no room for (DecodeSession::extend and append advance the
  // placement before they grow the shards), and reading them would run past the shards.
  bool unusable = false;
  std::string unusable_why;
  // An instance made with Session.__new__ and never initialized holds no session.
  DecodeSession& get() {
    if (!s) throw py::type_error("this Session was never initialized (call Session(comm, ...))");
    if (unusable) throw StatusError(Status(Code::kInternal, unusable_why));
    return *s;
  }
  std::vector<int64_t> row_lengths() const {
    const auto lens = s->plan().total_lens();
    return {lens.begin(), lens.end()};
  }
  // After a call that may have grown the rows: a failure that changed the row lengths leaves the
  // session unusable (see `unusable`), and every later call says why.
  void check_growth(const Status& st, const std::vector<int64_t>& before, const std::string& call) {
    if (!st.is_ok() && row_lengths() != before) {
      unusable = true;
      unusable_why =
          "rank " + std::to_string(s->comm().rank()) + ": this session is unusable: " + call +
          " failed after it had placed the new tokens (" + st.message() + "); make a new Session";
    }
    check(st);
  }
};

// A list of ints (node_of_rank) from None (empty) or a sequence of at most max_count ints.
std::vector<int> int_list(const py::object& o, const char* what, std::size_t max_count) {
  if (o.is_none()) return {};
  const std::vector<int64_t> v = to_int64_list(o, what, "a sequence of ints", max_count);
  std::vector<int> out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] < INT32_MIN || v[i] > INT32_MAX)
      invalid(std::string(what) + "[" + std::to_string(i) + "] is " + std::to_string(v[i]) +
              ", outside the range of a C int");
    out.push_back(static_cast<int>(v[i]));
  }
  return out;
}

// The communicator argument of Session: a Comm, checked here because pybind11 passes None on as
// a null pointer.
std::shared_ptr<PyComm> comm_of(const py::object& o) {
  if (!py::isinstance<PyComm>(o))
    throw py::type_error(
        "comm must be a treeattn.Comm (from treeattn.local_world, treeattn.run_local or "
        "treeattn.mpi_comm), got " +
        type_name(o));
  std::shared_ptr<PyComm> comm;
  try {
    comm = o.cast<std::shared_ptr<PyComm>>();
  } catch (const py::cast_error&) {  // a Comm made with Comm.__new__ has no holder
  }
  if (!comm || !comm->comm)
    throw py::type_error(
        "comm holds no communicator (make one with treeattn.local_world or treeattn.mpi_comm)");
  return comm;
}

// The longest timeout accepted, in seconds (about 31 years): longer ones would overflow the
// millisecond count, and "wait forever" is spelled 0.
constexpr double kMaxTimeoutSeconds = 1e9;

// topology= of Session (what strategy='auto' plans on): None (this job as the communicator
// shows it), a preset name ("emu-1gbit" or "preset:emu-1gbit"), a topology file's path, or a
// dict in the file's format (treeattn.topology_json's text, parsed).
std::optional<Topology> topology_of(const py::object& obj) {
  if (obj.is_none()) return std::nullopt;
  if (py::isinstance<py::dict>(obj)) {
    const std::string text = py::str(py::module_::import("json").attr("dumps")(obj));
    return unwrap(parse_topology_json(text, "topology"));
  }
  if (!py::isinstance<py::str>(obj))
    throw py::type_error("topology must be None, a preset name, a topology file's path or a "
                         "dict in the file's format, got " + type_name(obj));
  const std::string name = obj.cast<std::string>();
  const auto presets = preset_names();
  if (std::find(presets.begin(), presets.end(), name) != presets.end())
    return unwrap(preset_topology(name));
  return unwrap(load_topology(name));
}

std::unique_ptr<PySession> make_session(
    const py::object& comm_obj, int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
    int64_t q_len, const std::string& dtype, int layers, const std::string& placement,
    const py::object& context, const py::object& explicit_len, int holder, int64_t reserve_tokens,
    const std::string& strategy, int root, int fanout, const py::object& node_of_rank, float scale,
    const py::object& threads, const std::string& isa, double timeout_s, bool check_agreement,
    const py::object& agree_also, bool rows_start_free, const py::object& topology) {
  std::shared_ptr<PyComm> comm = comm_of(comm_obj);
  const int ranks = comm->comm->size();
  const auto rows_max = static_cast<std::size_t>(std::max<int64_t>(batch, 1));
  SessionConfig c;
  c.shape = AttnShape{batch, heads, kv_heads, head_dim, q_len};
  const auto t = parse_dtype(dtype);
  if (!t) invalid("unknown KV dtype '" + dtype + "' (known: f32, f16, bf16, fp8, int8)");
  c.dtype = *t;
  c.layers = layers;
  c.placement = unwrap(parse_shard_kind(placement));
  c.context = int_or_list(context, "context", rows_max);
  if (!explicit_len.is_none()) {
    // One length per rank, or one per rank and batch row (ShardPlan::make).
    const std::size_t most = rows_max > SIZE_MAX / static_cast<std::size_t>(ranks)
                                 ? SIZE_MAX
                                 : rows_max * static_cast<std::size_t>(ranks);
    c.explicit_len = to_int64_list(explicit_len, "explicit_len", "a sequence of ints", most);
    for (std::size_t i = 0; i < c.explicit_len.size(); ++i)
      if (c.explicit_len[i] < 0)
        invalid("explicit_len[" + std::to_string(i) + "] is " + std::to_string(c.explicit_len[i]) +
                ": explicit shard lengths must be >= 0");
  }
  if (holder < 0 || holder >= ranks)
    invalid("holder " + std::to_string(holder) + " is outside the ranks [0, " +
            std::to_string(ranks) + ") of comm");
  c.holder = holder;
  c.reserve_tokens = reserve_tokens;
  c.strategy = strategy;
  c.topology = topology_of(topology);
  c.options.root = root;
  c.options.fanout = fanout;
  c.options.node_of_rank = int_list(node_of_rank, "node_of_rank", static_cast<std::size_t>(ranks));
  c.options.kernel.scale = scale;
  c.options.kernel.threads = thread_count(threads);
  c.options.kernel.isa = unwrap(parse_isa(isa));
  // Written so that NaN fails it too.
  if (!(timeout_s >= 0 && timeout_s <= kMaxTimeoutSeconds))
    invalid("timeout must be a number of seconds in [0, 1e9] (0 waits forever), got " +
            std::string(py::str(py::float_(timeout_s))));
  c.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0 + 0.5));
  c.check_agreement = check_agreement;
  c.rows_start_free = rows_start_free;
  if (!agree_also.is_none()) {
    try {
      c.agree_also = agree_also.cast<std::vector<std::pair<std::string, std::string>>>();
    } catch (const py::cast_error&) {
      throw py::type_error("agree_also must be a sequence of (name, value) pairs of str, got " +
                           type_name(agree_also));
    }
  }
  auto out = std::make_unique<PySession>();
  out->comm = std::move(comm);
  Communicator& cm = *out->comm->comm;
  Result<std::unique_ptr<DecodeSession>> r = [&] {
    py::gil_scoped_release nogil;
    return DecodeSession::create(cm, c);
  }();
  out->s = unwrap(std::move(r));
  return out;
}

// Checks a [*lead, kv_heads, head_dim]-shaped float32 K or V block of a session (the shape before
// any copy, so that a huge view of the wrong shape is a shape error).
F32Array kv_block(const py::array& a, const char* what, std::vector<int64_t> want,
                  const char* layout) {
  if (!has_shape(a, want)) {
    std::string w = "(";
    for (std::size_t i = 0; i < want.size(); ++i) w += (i ? ", " : "") + std::to_string(want[i]);
    invalid(std::string(what) + " must have shape " + w + ") " + layout + ", got " + shape_text(a));
  }
  return as_f32(a, what);
}

F32Array session_query(const DecodeSession& s, const py::array& q_in) {
  const AttnShape& sh = s.shape();
  return kv_block(q_in, "q", {sh.batch, sh.q_len, sh.heads, sh.head_dim},
                  "[batch, q_len, heads, head_dim]");
}

void store_py(PySession& ps, int layer, int64_t b, const py::object& pos, const py::array& k_in,
              const py::array& v_in) {
  DecodeSession& s = ps.get();
  const AttnShape& sh = s.shape();
  const auto per = static_cast<std::size_t>(sh.kv_heads * sh.head_dim);
  if (is_int(pos)) {
    const int64_t p = to_int64(pos, "pos");
    F32Array k = kv_block(k_in, "k", {sh.kv_heads, sh.head_dim}, "[kv_heads, head_dim]");
    F32Array v = kv_block(v_in, "v", {sh.kv_heads, sh.head_dim}, "[kv_heads, head_dim]");
    check(s.store(layer, b, p, k.data(), v.data()));
    return;
  }
  // As many positions as k has rows (k's shape is checked against their count below).
  const auto most = static_cast<std::size_t>(k_in.ndim() >= 1 ? k_in.shape(0) : 0);
  const auto positions =
      to_int64_list(pos, "pos", "an int or a sequence of ints (positions of row b)", most);
  const auto n = static_cast<int64_t>(positions.size());
  F32Array k =
      kv_block(k_in, "k", {n, sh.kv_heads, sh.head_dim}, "[positions, kv_heads, head_dim]");
  F32Array v =
      kv_block(v_in, "v", {n, sh.kv_heads, sh.head_dim}, "[positions, kv_heads, head_dim]");
  for (std::size_t i = 0; i < positions.size(); ++i)
    check(s.store(layer, b, positions[i], k.data() + i * per, v.data() + i * per));
}

// Refuses an extend whose new tokens cannot fit in the memory this process can have, before the
// session walks them: DecodeSession::extend places the tokens of a non-empty session one at a
// time and only then sizes the shards, so extend(2**62) would run for years, and a failed growth
// leaves the session unusable (PySession::check_growth). The bound only depends on values every
// rank shares (on one machine), so every rank refuses the same call.
// seq < 0: extend(n) of every row; else extend(seq, n) of that one sequence (placed the same way,
// so the same bound with one row).
void check_extend_fits(const DecodeSession& s, int64_t n, int64_t seq = -1) {
  const ShardPlan& plan = s.plan();
  if (n <= 0) return;
  const int64_t first = seq < 0 ? 0 : seq, end = seq < 0 ? plan.batch() : seq + 1;
  bool empty = true;
  for (int64_t b = first; b < end; ++b) empty = empty && plan.total_len(b) == 0;
  // The tokens of empty rows are laid out by the placement, and whatever it is some rank gets
  // at least n / ranks of each row; on non-empty rows they go to one rank per row (the last
  // rank, or the holder), or round-robin when striped.
  // In double: the products can pass 2**64, and the comparison needs no more precision.
  const double share = empty || plan.kind() == ShardKind::kStriped
                           ? std::ceil(static_cast<double>(n) / plan.ranks())
                           : static_cast<double>(n);
  const AttnShape& sh = s.shape();
  const double token_bytes = static_cast<double>(sh.kv_heads) * static_cast<double>(sh.head_dim) *
                             static_cast<double>(dtype_size(s.config().dtype)) * 2;  // K and V
  const double bytes = share * static_cast<double>(end - first) * token_bytes * s.layers();
  const uint64_t memory = memory_limit();
  if (memory == 0 || bytes <= static_cast<double>(memory)) return;
  const std::string least = bytes < 1e18 ? std::to_string(static_cast<uint64_t>(bytes))
                                         : std::string(py::str(py::float_(bytes)));
  throw StatusError(Status(
      Code::kOutOfMemory,
      "rank " + std::to_string(s.comm().rank()) + ": extend: " + std::to_string(n) +
          (seq < 0 ? " more tokens per row" : " more tokens of sequence " + std::to_string(seq)) +
          " would put at least " + least +
          " bytes of K and V on one rank, more than the memory this process can have (" +
          std::to_string(memory) + " bytes)"));
}

std::vector<int64_t> plan_row(const ShardPlan& plan, int rank, bool starts) {
  if (rank < 0 || rank >= plan.ranks())
    invalid("rank " + std::to_string(rank) + " is outside [0, " + std::to_string(plan.ranks()) +
            ")");
  auto sp = starts ? plan.pos_starts(rank) : plan.lens(rank);
  return {sp.begin(), sp.end()};
}

// A sequence slot argument: an int in [0, batch), as the session's own check words it (so that a
// huge or negative value is an InvalidArgumentError, not pybind11's cast error).
int64_t sequence_arg(const DecodeSession& s, const py::handle& o, const char* op) {
  const int64_t seq = to_int64(o, "seq");
  if (seq < 0 || seq >= s.shape().batch)
    invalid("rank " + std::to_string(s.comm().rank()) + ": " + op + ": sequence " +
            std::to_string(seq) + " is outside [0, " + std::to_string(s.shape().batch) + ")");
  return seq;
}

// Session.extend(n, seq=None): every row (extend(n)) or one sequence (extend(seq, n)).
void extend_py(PySession& ps, const py::object& n_obj, const py::object& seq_obj) {
  DecodeSession& s = ps.get();
  const int64_t n = to_int64(n_obj, "n");
  if (seq_obj.is_none()) {
    check_extend_fits(s, n);
    const std::vector<int64_t> before = ps.row_lengths();
    ps.check_growth(s.extend(n), before, "extend(" + std::to_string(n) + ")");
    return;
  }
  const int64_t seq = sequence_arg(s, seq_obj, "extend");
  // A free slot: the session's own error (it places nothing), before the memory bound is read.
  if (!s.live(seq)) check(s.extend(seq, n));
  check_extend_fits(s, n, seq);
  const std::vector<int64_t> before = ps.row_lengths();
  ps.check_growth(s.extend(seq, n), before,
                  "extend(" + std::to_string(n) + ", seq=" + std::to_string(seq) + ")");
}

// Session.store_range(layer, seq, pos0, k, v): k, v [n, kv_heads, head_dim] float32.
void store_range_py(PySession& ps, int layer, const py::object& seq_obj, const py::object& pos0_obj,
                    const py::array& k_in, const py::array& v_in) {
  DecodeSession& s = ps.get();
  const AttnShape& sh = s.shape();
  const int64_t seq = sequence_arg(s, seq_obj, "store_range");
  const int64_t pos0 = to_int64(pos0_obj, "pos0");
  expect_ndim(k_in, 3, "k", "[positions, kv_heads, head_dim]");
  const int64_t n = k_in.shape(0);
  F32Array k =
      kv_block(k_in, "k", {n, sh.kv_heads, sh.head_dim}, "[positions, kv_heads, head_dim]");
  F32Array v =
      kv_block(v_in, "v", {n, sh.kv_heads, sh.head_dim}, "[positions, kv_heads, head_dim]");
  const float* kp = k.data();
  const float* vp = v.data();
  Status st;
  {
    py::gil_scoped_release nogil;
    st = s.store_range(layer, seq, pos0, n, kp, vp);
  }
  check(st);
}

// Session.attend(layer, q, seqs=None): the whole batch, or the live sequences `seqs` with q
// [len(seqs), q_len, heads, head_dim]. (out, lse) in the order of q; None on a rank that gets no
// result (root >= 0).
py::object attend_py(PySession& ps, int layer, const py::array& q_in, const py::object& seqs_obj) {
  DecodeSession& s = ps.get();
  const AttnShape& sh = s.shape();
  std::optional<std::vector<int64_t>> seqs;
  if (!seqs_obj.is_none())
    seqs = to_int64_list(seqs_obj, "seqs", "a sequence of ints (live sequences)",
                         static_cast<std::size_t>(sh.batch));
  const int64_t rows = seqs ? static_cast<int64_t>(seqs->size()) : sh.batch;
  F32Array q = seqs ? kv_block(q_in, "q", {rows, sh.q_len, sh.heads, sh.head_dim},
                               "[len(seqs), q_len, heads, head_dim]")
                    : session_query(s, q_in);
  py::array_t<float> out(dims({rows, sh.q_len, sh.heads, sh.head_dim}));
  py::array_t<float> lse(dims({rows, sh.q_len, sh.heads}));
  float* op = out.mutable_data();
  float* lp = lse.mutable_data();
  const float* qp = q.data();
  Status st;
  {
    py::gil_scoped_release nogil;
    st = seqs ? s.attend(layer, *seqs, qp, op, lp) : s.attend(layer, qp, op, lp);
  }
  check(st);
  if (!s.delivers_result()) return py::none();
  return py::make_tuple(out, lse);
}

}  // namespace
}  // namespace treeattn::python

PYBIND11_MODULE(_treeattn, m) {
  using namespace treeattn;          // NOLINT(google-build-using-namespace)
  using namespace treeattn::python;  // NOLINT(google-build-using-namespace)
  m.doc() = "treeattn: exact distributed attention decoding (C++ core, numpy bindings)";

  // Exceptions: treeattn.Error, and one subclass per Status code.
  py::module_ builtins = py::module_::import("builtins");
  py::object exc = builtins.attr("Exception"), value_error = builtins.attr("ValueError"),
             runtime_error = builtins.attr("RuntimeError");
  PyObject* base =
      make_error(m, "Error", py::make_tuple(exc),
                 "A treeattn Status that is not ok; str() is its message, .code its code name.");
  py::object base_error = py::reinterpret_borrow<py::object>(base);
  auto sub = [&](Code c, const char* name, py::object other, const char* doc) {
    g_errors[static_cast<std::size_t>(c)] =
        make_error(m, name, py::make_tuple(base_error, other), doc);
  };
  sub(Code::kInvalidArgument, "InvalidArgumentError", value_error,
      "A caller-supplied value is out of range or inconsistent.");
  sub(Code::kUnsupported, "UnsupportedError", runtime_error,
      "A valid request this build cannot serve (head dim, dtype, ISA).");
  sub(Code::kMismatch, "MismatchError", runtime_error, "Ranks disagree on a shape, dtype or plan.");
  sub(Code::kTimeout, "PeerTimeoutError", runtime_error,
      "A peer rank did not arrive within the configured time.");
  sub(Code::kNumerics, "NumericsError", runtime_error,
      "An opt-in check found NaN/Inf in an input.");
  sub(Code::kInternal, "InternalError", runtime_error, "A backend call failed.");
  sub(Code::kOutOfMemory, "OutOfMemoryError", runtime_error,
      "A requested allocation would not fit.");
  g_errors[static_cast<std::size_t>(Code::kOk)] =
      g_errors[static_cast<std::size_t>(Code::kInternal)];
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusError& e) {
      set_python_error(e.status());
    }
  });

#if defined(TREEATTN_PY_WITH_MPI)
  m.attr("has_mpi") = true;
#else
  m.attr("has_mpi") = false;
#endif
  m.attr("supported_head_dims") =
      py::cast(std::vector<int>(std::begin(kSupportedHeadDims), std::end(kSupportedHeadDims)));
  m.def(
      "best_isa", [] { return std::string(isa_name(best_isa())); },
      "The best kernel ISA this CPU supports.");

  m.def("decode_partial", &decode_partial_py, py::arg("q"), py::arg("k"), py::arg("v"),
        py::kw_only(), py::arg("dtype") = py::none(), py::arg("scale") = 0.0f,
        py::arg("lengths") = py::none(), py::arg("pos_start") = py::none(),
        py::arg("total_len") = py::none(), py::arg("pos_stride") = 1, py::arg("threads") = 0,
        py::arg("chunk_tokens") = 0, py::arg("isa") = "auto",
        R"(Partial attention states of q against one KV shard (kernel.hpp).

q [B, Q, H, D] float32; k, v [B, Hkv, N, D] float32, float16, or uint16 with dtype="bf16" (any
strides with head_dim contiguous; never copied). lengths: tokens used per row (default N);
pos_start: global position of each row's first token (default 0); total_len: the whole
context length per row (default: one past the row's last token), which sets the causal limit
of multi-token queries; pos_stride: position step between tokens (striped shards).
scale 0 means 1/sqrt(D); threads 0 means OpenMP's default, else 1..1024. Returns states
[B, Q, H, D + 2] float32 records [m, l, o...].)");
  m.def("oracle", &oracle_py, py::arg("q"), py::arg("k"), py::arg("v"), py::kw_only(),
        py::arg("dtype") = py::none(), py::arg("scale") = 0.0, py::arg("lengths") = py::none(),
        py::arg("pos_start") = py::none(), py::arg("total_len") = py::none(),
        py::arg("pos_stride") = 1,
        "The float64 oracle (oracle.hpp) over the same arguments as decode_partial: returns "
        "(out [B, Q, H, D] float64, lse [B, Q, H] float64, natural log).");
  m.def("merge_states", &merge_states_py, py::arg("a"), py::arg("b"), py::kw_only(),
        py::arg("out") = py::none(),
        "Merges two arrays of state records [..., D + 2] (state.hpp) into out (a new array, or "
        "a writeable C-contiguous float32 array of a's shape, which may be a or b).");
  m.def("normalize", &normalize_py, py::arg("states"),
        "(out [..., D], lse [...]) of state records [..., D + 2]: o / l and m + log(l).");

  py::class_<PyComm, std::shared_ptr<PyComm>>(m, "Comm",
                                              "A treeattn communicator (MPI or in-process).")
      .def_property_readonly("rank", [](const PyComm& c) { return c.get().rank(); })
      .def_property_readonly("size", [](const PyComm& c) { return c.get().size(); })
      .def_property_readonly("backend",
                             [](const PyComm& c) { return std::string(c.get().backend_name()); })
      .def(
          "strategies",
          [](const PyComm& c) {
            std::vector<std::pair<std::string, std::string>> out;
            for (const StrategyInfo& i :
                 StrategyRegistry::for_backend(c.get().capabilities()).list())
              out.emplace_back(std::string(i.name), std::string(i.summary));
            return out;
          },
          "(name, summary) of the strategies this backend offers.")
      .def(
          "strategy_info",
          [](const PyComm& c, const std::string& name) {
            const StrategyInfo* i =
                StrategyRegistry::for_backend(c.get().capabilities()).info(name);
            if (i == nullptr)
              check(StrategyRegistry::for_backend(c.get().capabilities())
                        .create(name, StrategyOptions{})
                        .status());
            const char* placement = i->placement == PlacementNeed::kAllOnRoot ? "all-on-root"
                                    : i->placement == PlacementNeed::kContiguous ? "contiguous"
                                                                                 : "any";
            py::dict d;
            d["name"] = std::string(i->name);
            d["summary"] = std::string(i->summary);
            d["placement"] = placement;
            d["reads_every_shard"] = i->reads_every_shard;
            d["holds_every_state"] = i->holds_every_state;
            d["rank_count_invariant"] = i->rank_count_invariant;
            d["listed"] = i->listed;
            return d;
          },
          py::arg("name"),
          "What the strategy's descriptor says (strategy.hpp StrategyInfo): placement ('any', "
          "'contiguous' or 'all-on-root'), reads_every_shard, holds_every_state, "
          "rank_count_invariant, listed. Unknown names raise InvalidArgumentError.")
      .def("__repr__", [](const PyComm& c) {
        if (!c.comm) return std::string("<treeattn.Comm (none)>");
        return "<treeattn.Comm " + std::string(c.comm->backend_name()) + " rank " +
               std::to_string(c.comm->rank()) + " of " + std::to_string(c.comm->size()) + ">";
      });

  m.def(
      "local_world",
      [](int size, const py::object& node_of_rank) {
        // Each rank is a thread of the caller's (run_local): far more would only exhaust memory
        // building the communicators.
        if (size < 1 || size > kMaxLocalRanks)
          invalid("local_world: size must be in [1, " + std::to_string(kMaxLocalRanks) + "], got " +
                  std::to_string(size));
        LocalWorldOptions o;
        o.node_of_rank = int_list(node_of_rank, "node_of_rank", static_cast<std::size_t>(size));
        auto comms = unwrap(make_local_world(size, o));
        std::vector<std::shared_ptr<PyComm>> out;
        for (auto& c : comms) {
          auto pc = std::make_shared<PyComm>();
          pc->comm = std::move(c);
          out.push_back(std::move(pc));
        }
        return out;
      },
      py::arg("size"), py::arg("node_of_rank") = py::none(),
      "size in-process communicators sharing one world (comm_local.hpp): hand communicator r "
      "to the thread that plays rank r.");
  m.def(
      "topology_json",
      [](const py::object& topology) {
        const std::optional<Topology> t = topology_of(topology);
        if (!t) throw py::type_error("topology_json: give a topology, not None");
        return topology_to_json(*t);
      },
      py::arg("topology"),
      "A topology (a preset name, 'preset:NAME' or a file's path) as the JSON text of the "
      "topology file format; json.loads of it is a dict Session(topology=...) takes.");
#if defined(TREEATTN_PY_WITH_MPI)
  m.def(
      "_mpi_comm_from_fortran",
      [](int64_t handle) {
        auto pc = std::make_shared<PyComm>();
        pc->comm = unwrap(mpi_wrap_fortran(handle));
        pc->mpi = true;
        return pc;
      },
      py::arg("handle"), "A Comm duplicating the MPI communicator with this Fortran handle.");
#endif

  py::class_<PySession>(m, "Session", R"(The decode session (session.hpp): this rank's KV shards of
every layer under one placement, and the strategy that merges the ranks' partial states.
Collective calls (the constructor, append, attend, attend_states, add_strategy,
check_agreement) must be made by every rank in the same order.

Sequences (rows_start_free=True: the batch rows are free sequence slots at creation, context
must be 0): add_sequence, remove_sequence, extend(n, seq=...), store_range and
attend(layer, q, seqs=...). The sequence calls are local and deterministic: every rank makes
the same ones in the same order, so every rank keeps the same placement without a message.
attend_states, add_strategy and delivers_result(strategy) are the benchmark and check calls
(treeattn_measure's measure.hpp in C++).)")
      .def(py::init(&make_session), py::arg("comm"), py::kw_only(), py::arg("batch") = 1,
           py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("q_len") = 1,
           py::arg("dtype") = "bf16", py::arg("layers") = 1, py::arg("placement") = "even",
           py::arg("context") = py::int_(0), py::arg("explicit_len") = py::none(),
           py::arg("holder") = 0, py::arg("reserve_tokens") = 0, py::arg("strategy") = "tree",
           py::arg("root") = -1, py::arg("fanout") = 2, py::arg("node_of_rank") = py::none(),
           py::arg("scale") = 0.0f, py::arg("threads") = 0, py::arg("isa") = "auto",
           py::arg("timeout") = 60.0, py::arg("check_agreement") = true,
           py::arg("agree_also") = py::none(), py::arg("rows_start_free") = false,
           py::arg("topology") = py::none())
      .def_property_readonly("rank", [](PySession& s) { return s.get().comm().rank(); })
      .def_property_readonly("size", [](PySession& s) { return s.get().comm().size(); })
      .def_property_readonly("layers", [](PySession& s) { return s.get().layers(); })
      .def_property_readonly("batch", [](PySession& s) { return s.get().shape().batch; })
      .def_property_readonly("heads", [](PySession& s) { return s.get().shape().heads; })
      .def_property_readonly("kv_heads", [](PySession& s) { return s.get().shape().kv_heads; })
      .def_property_readonly("head_dim", [](PySession& s) { return s.get().shape().head_dim; })
      .def_property_readonly("q_len", [](PySession& s) { return s.get().shape().q_len; })
      .def_property_readonly(
          "dtype", [](PySession& s) { return std::string(dtype_name(s.get().config().dtype)); })
      .def_property_readonly("strategy", [](PySession& s) { return s.get().config().strategy; })
      .def_property_readonly(
          "auto_choice",
          [](PySession& s) -> py::object {
            const StrategyChoice* c = s.get().auto_choice();
            if (c == nullptr) return py::none();
            py::list ranking;
            for (const PlanEntry& e : c->ranking)
              ranking.append(py::make_tuple(e.prediction.strategy, e.prediction.latency_us,
                                            e.prediction.local_us, e.prediction.comm_us,
                                            e.feasible));
            py::dict d;
            d["strategy"] = c->strategy;
            d["topology"] = c->topology;
            d["ranking"] = ranking;
            return d;
          },
          "With strategy='auto': {'strategy', 'topology', 'ranking': [(name, latency_us, "
          "local_us, comm_us, feasible), best first]}, the same on every rank; None otherwise.")
      .def_property_readonly("plan", [](PySession& s) { return s.get().plan().to_string(); })
      .def_property_readonly("pos_stride", [](PySession& s) { return s.get().plan().pos_stride(); })
      .def_property_readonly("live_kv_bytes", [](PySession& s) { return s.get().live_kv_bytes(); })
      .def(
          "length",
          [](PySession& s, int64_t b) {
            if (b < 0 || b >= s.get().shape().batch)
              invalid("batch row " + std::to_string(b) + " is outside [0, " +
                      std::to_string(s.get().shape().batch) + ")");
            return s.get().length(b);
          },
          py::arg("b"), "Tokens in row b (over all ranks).")
      .def(
          "owns", [](PySession& s, int64_t b, int64_t pos) { return s.get().owns(b, pos); },
          py::arg("b"), py::arg("pos"), "Whether this rank holds position pos of row b.")
      .def(
          "shard_lengths",
          [](PySession& s, std::optional<int> rank) {
            return plan_row(s.get().plan(), rank.value_or(s.get().comm().rank()), false);
          },
          py::arg("rank") = py::none(),
          "Tokens per batch row that a rank (default: this one) holds.")
      .def(
          "shard_starts",
          [](PySession& s, std::optional<int> rank) {
            return plan_row(s.get().plan(), rank.value_or(s.get().comm().rank()), true);
          },
          py::arg("rank") = py::none(), "Global position of each row's first token on a rank.")
      .def(
          "owned_positions",
          [](PySession& s, int64_t b, std::optional<int> rank) {
            const ShardPlan& plan = s.get().plan();
            if (b < 0 || b >= plan.batch())
              invalid("batch row " + std::to_string(b) + " is outside [0, " +
                      std::to_string(plan.batch()) + ")");
            const int r = rank.value_or(s.get().comm().rank());
            const int64_t start = plan_row(plan, r, true)[static_cast<std::size_t>(b)];
            const int64_t len = plan.len(r, b);
            py::array_t<int64_t> out(dims({len}));
            int64_t* p = out.mutable_data();
            for (int64_t j = 0; j < len; ++j) p[j] = start + j * plan.pos_stride();
            return out;
          },
          py::arg("b"), py::arg("rank") = py::none(),
          "The global positions of row b that a rank (default: this one) holds, in slot order.")
      .def("extend", &extend_py, py::arg("n"), py::kw_only(), py::arg("seq") = py::none(),
           "Grows every row by n tokens (a prefill on an empty session); owners then store() "
           "them. With seq: grows that live sequence only (an empty one is laid out by the "
           "placement), and the K/V are written with store_range.")
      .def("store", &store_py, py::arg("layer"), py::arg("b"), py::arg("pos"), py::arg("k"),
           py::arg("v"),
           "Writes K and V of position pos (an int, with k, v [kv_heads, head_dim]) or of several "
           "positions (a sequence, with k, v [positions, kv_heads, head_dim]) of row b; this rank "
           "must own them.")
      .def(
          "append",
          [](PySession& ps, const py::array& k_in, const py::array& v_in) {
            DecodeSession& s = ps.get();
            const AttnShape& sh = s.shape();
            const std::vector<int64_t> want = {s.layers(), sh.batch, sh.kv_heads, sh.head_dim};
            F32Array k = kv_block(k_in, "k", want, "[layers, batch, kv_heads, head_dim]");
            F32Array v = kv_block(v_in, "v", want, "[layers, batch, kv_heads, head_dim]");
            const float* kp = k.data();
            const float* vp = v.data();
            const std::vector<int64_t> before = ps.row_lengths();
            Status st;
            {
              py::gil_scoped_release nogil;
              st = s.append(kp, vp);
            }
            ps.check_growth(st, before, "append");
          },
          py::arg("k"), py::arg("v"),
          "Collective. Appends one token to every row of every layer (k, v [layers, batch, "
          "kv_heads, head_dim], the same on every rank); only its owner stores it.")
      .def("attend", &attend_py, py::arg("layer"), py::arg("q"), py::kw_only(),
           py::arg("seqs") = py::none(),
           "Collective. (out [B, Q, H, D], lse [B, Q, H]) float32: exact attention over every "
           "rank's tokens of the layer; None on ranks that get no result (root >= 0). With seqs "
           "(distinct live sequences, the same list on every rank): q and out are "
           "[len(seqs), Q, H, D] and lse [len(seqs), Q, H], in the order of seqs; the other "
           "rows are not read.")
      .def(
          "add_sequence", [](PySession& ps) { return unwrap(ps.get().add_sequence()); },
          "The lowest free sequence slot (batch row), now live and empty. OutOfMemoryError when "
          "all batch slots are live. Local: every rank makes the same sequence calls in the "
          "same order.")
      .def(
          "remove_sequence",
          [](PySession& ps, const py::object& seq) {
            DecodeSession& s = ps.get();
            check(s.remove_sequence(sequence_arg(s, seq, "remove_sequence")));
          },
          py::arg("seq"), "The sequence's slot becomes free and empty (reused by add_sequence).")
      .def(
          "live",
          [](PySession& ps, const py::object& seq) {
            DecodeSession& s = ps.get();
            return s.live(to_int64(seq, "seq"));
          },
          py::arg("seq"), "Whether seq is a live sequence (False outside [0, batch)).")
      .def(
          "live_sequences", [](PySession& ps) { return ps.get().live_sequences(); },
          "How many sequences are live.")
      .def("store_range", &store_range_py, py::arg("layer"), py::arg("seq"), py::arg("pos0"),
           py::arg("k"), py::arg("v"),
           "Writes K and V (k, v [n, kv_heads, head_dim] float32, the same on every rank) of "
           "positions pos0 .. pos0 + n - 1 of a live sequence; each rank keeps the positions it "
           "owns. Extend the sequence first.")
      .def(
          "attend_states",
          [](PySession& ps, int layer, const py::array& q_in, int strategy) {
            DecodeSession& s = ps.get();
            const AttnShape& sh = s.shape();
            F32Array q = session_query(s, q_in);
            StateBuffer states;
            const float* qp = q.data();
            {
              py::gil_scoped_release nogil;
              check(measure::attend_states(s, layer, qp, states, strategy));
            }
            py::array_t<float> out(dims({sh.batch, sh.q_len, sh.heads, sh.head_dim + 2}));
            std::memcpy(out.mutable_data(), states.data(), states.bytes());
            return out;
          },
          py::arg("layer"), py::arg("q"), py::arg("strategy") = 0,
          "Collective. The merged state records [B, Q, H, D + 2] (strategy: an index from "
          "add_strategy, 0 = the configured one).")
      .def(
          "delivers_result",
          [](PySession& s, int strategy) {
            const int count = measure::strategy_count(s.get());
            if (strategy < 0 || strategy >= count)
              invalid("strategy index " + std::to_string(strategy) + " is outside [0, " +
                      std::to_string(count) + ")");
            return measure::delivers_result(s.get(), strategy);
          },
          py::arg("strategy") = 0)
      .def(
          "add_strategy",
          [](PySession& ps, const std::string& name, int root, int fanout,
             const py::object& node_of_rank) {
            StrategyOptions o = ps.get().config().options;
            o.root = root;
            o.fanout = fanout;
            o.node_of_rank = int_list(node_of_rank, "node_of_rank",
                                      static_cast<std::size_t>(ps.get().comm().size()));
            py::gil_scoped_release nogil;
            return unwrap(measure::add_strategy(ps.get(), name, o));
          },
          py::arg("name"), py::kw_only(), py::arg("root") = -1, py::arg("fanout") = 2,
          py::arg("node_of_rank") = py::none(),
          "Collective. One more strategy on the same shards; returns its index for attend_states.")
      .def(
          "check_agreement",
          [](PySession& ps, const std::string& when,
             const std::vector<std::pair<std::string, std::string>>& extra) {
            py::gil_scoped_release nogil;
            check(ps.get().check_agreement(when, extra));
          },
          py::arg("when") = "",
          py::arg("extra") = std::vector<std::pair<std::string, std::string>>{},
          "Collective. Fails with MismatchError naming the ranks and fields that differ.");
}
