// libFuzzer target: `treeattn serve`'s HTTP request reader (src/serve/http_request.hpp) on
// arbitrary bytes, as a connection's pipeline of requests. The first input byte picks the
// limits (bit 0: small ones, so that every cap is reached) and the size of the pieces the bytes
// arrive in (bits 1-7); the rest is the wire. Every request is read twice, at once and in
// pieces, and both readings must agree (state, status, bytes consumed, body); a refusal is one of
// the statuses the header lists, with a message whose error body is JSON; a complete request
// respects the limits, and its normalized form (what cpp-httplib reads) reads back to the same
// request.
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "serve/api.hpp"
#include "serve/format.hpp"
#include "serve/http_request.hpp"

namespace {

using namespace treeattn::serve;

// A failed check names itself before aborting (libFuzzer keeps the input).
#define check(cond)                                                         \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "check failed, line %d: %s\n", __LINE__, #cond); \
      std::abort();                                                         \
    }                                                                       \
  } while (0)

struct Reading {
  RequestReader::State state;
  int status;
  std::size_t consumed;
  HttpRequest req;
  std::string message;
};

// One request from the front of `wire`, fed `step` bytes at a time (0: all at once).
Reading read_one(std::string_view wire, std::size_t step, const RequestLimits& limits) {
  RequestReader r(limits);
  std::size_t pos = 0;
  while (true) {
    const std::size_t n = step == 0 ? wire.size() - pos : std::min(step, wire.size() - pos);
    const std::size_t took = r.feed(wire.substr(pos, n));
    check(took <= n);
    pos += took;
    if (r.state() == RequestReader::State::kHeadDone) {
      r.read_body();
      continue;
    }
    if (r.state() == RequestReader::State::kDone || r.state() == RequestReader::State::kError)
      break;
    if (pos >= wire.size()) break;
    check(took == n);  // while reading, every offered byte is taken
  }
  check(r.consumed() == pos);
  return Reading{r.state(), r.status(), r.consumed(), r.request(), r.message()};
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  RequestLimits limits;
  if ((data[0] & 1) != 0) {
    limits.max_line = 40;
    limits.max_headers = 3;
    limits.max_head = 120;
    limits.max_body = 16;
  }
  const std::size_t step = data[0] >> 1;
  std::string_view wire(reinterpret_cast<const char*>(data + 1), size - 1);
  for (int k = 0; k < 16 && !wire.empty(); ++k) {  // a pipeline
    const Reading whole = read_one(wire, 0, limits);
    const Reading pieces = read_one(wire, step == 0 ? 1 : step, limits);
    check(whole.state == pieces.state && whole.status == pieces.status);
    if (whole.state == RequestReader::State::kError) {
      const int s = whole.status;
      check(s == 400 || s == 411 || s == 413 || s == 414 || s == 415 || s == 431 || s == 501 ||
            s == 505);
      check(!whole.message.empty());  // (the bytes consumed by then do not matter: it closes)
      const ApiError e{s, whole.message, "invalid_request_error", "", ""};
      check(nlohmann::json::parse(error_body(e))["error"]["message"] == whole.message);
      return 0;
    }
    if (whole.state != RequestReader::State::kDone) return 0;  // incomplete: waits for more
    check(whole.consumed == pieces.consumed && whole.req.body == pieces.req.body);
    check(whole.req.body.size() <= limits.max_body);
    check(whole.req.headers.size() <= limits.max_headers);
    check(whole.consumed > 0 && whole.consumed <= wire.size());
    // What cpp-httplib is given reads back to the same request (under limits that fit it).
    RequestLimits roomy;
    roomy.max_line = limits.max_line + 2;  // "A:v" is written "A: v"
    roomy.max_headers = limits.max_headers + 1;
    roomy.max_head = 1 << 20;
    roomy.max_body = limits.max_body;
    const std::string n = whole.req.normalized();
    const Reading again = read_one(n, 0, roomy);
    check(again.state == RequestReader::State::kDone && again.consumed == n.size());
    check(again.req.body == whole.req.body && again.req.method == whole.req.method &&
          again.req.target == whole.req.target && again.req.version == whole.req.version);
    wire.remove_prefix(whole.consumed);
  }
  return 0;
}
