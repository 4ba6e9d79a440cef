// libFuzzer target: the GGUF reader (include/treeattn/gguf.hpp) on arbitrary bytes. The reader
// promises that opening validates every length, count, offset and size against the file, so
// that afterwards every string_view and tensor pointer it hands out lies inside the mapping:
// this target opens each input as a file (an in-memory memfd) and, when it opens, reads every
// metadata value through every typed accessor and dequantizes and dots the first row of every
// supported tensor. A read outside the mapping is a sanitizer report or a fault; an error must
// be a Status whose message names the file.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "treeattn/gguf.hpp"

namespace {

int memfd() {
  static const int fd = memfd_create("fuzz.gguf", 0);
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  using namespace treeattn::gguf;
  const int fd = memfd();
  if (fd < 0 || ftruncate(fd, 0) != 0) __builtin_trap();
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (n <= 0) __builtin_trap();
    done += static_cast<std::size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  treeattn::Result<File> f = File::open(path);
  if (!f.is_ok()) {
    if (f.status().message().find("gguf " + path) == std::string::npos) {
      std::fprintf(stderr, "error without the file: %s\n", f.status().message().c_str());
      __builtin_trap();
    }
    return 0;
  }
  volatile double sink = 0;
  for (const KeyValue& kv : f->metadata()) {
    const std::string key(kv.key);
    if (f->find(kv.key) == nullptr) __builtin_trap();
    if (auto s = f->get_string(key); s.is_ok()) sink = sink + static_cast<double>(s->size());
    if (auto b = f->get_bool(key); b.is_ok()) sink = sink + (*b ? 1 : 0);
    if (auto i = f->get_int(key); i.is_ok()) sink = sink + static_cast<double>(*i);
    if (auto u = f->get_uint(key); u.is_ok()) sink = sink + static_cast<double>(*u);
    if (auto d = f->get_float(key); d.is_ok()) sink = sink + *d;
    if (auto a = f->get_string_array(key); a.is_ok())
      for (std::string_view s : *a) sink = sink + (s.empty() ? 0 : s.front());
    if (auto a = f->get_int_array(key); a.is_ok())
      for (int64_t v : *a) sink = sink + static_cast<double>(v);
    if (auto a = f->get_float_array(key); a.is_ok())
      for (double v : *a) sink = sink + v;
  }
  std::vector<float> row, x;
  for (const TensorInfo& t : f->tensors()) {
    if (f->find_tensor(t.name) == nullptr) __builtin_trap();
    uint64_t end = 0;  // the tensor must end inside the file
    if (__builtin_add_overflow(f->data_offset(), t.offset, &end) ||
        __builtin_add_overflow(end, t.n_bytes, &end) || end > f->file_size())
      __builtin_trap();
    auto got = f->tensor(t.name);
    if (!got.is_ok() || t.n_rows() == 0) continue;
    // The first row, at most 4096 values (whole blocks).
    const uint64_t cols = t.n_elements / t.n_rows();
    const uint64_t block = std::max<uint32_t>(1, block_layout(t.type).block_elems);
    const std::size_t n = static_cast<std::size_t>(std::min<uint64_t>(cols, 4096) / block * block);
    if (n == 0) continue;
    row.assign(n, 0.0f);
    x.assign(n, 0.5f);
    if (dequantize_row(t.type, t.row(0), row.data(), n).is_ok())
      sink = sink + static_cast<double>(row[0]) + static_cast<double>(row[n - 1]);
    if (auto d = dot_row_reference(t.type, t.row(t.n_rows() - 1), x.data(), n); d.is_ok())
      sink = sink + *d;
  }
  (void)sink;
  return 0;
}
