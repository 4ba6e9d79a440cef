// The server's reader of HTTP/1.x requests: bytes in, one bounded request (or the status that
// refuses it) out. Pure, no sockets: the server's connection loop (connection_loop.cpp) feeds it
// what a connection receives, checks the head before any of the body is read (the API key, a
// route answered at once), and hands the complete request, its body de-chunked, to cpp-httplib's
// request processing; the bytes after it stay with the connection (pipelined requests). Unit-
// tested (tests/serve/test_serve.cpp) and fuzzed (fuzz/fuzz_serve_request.cpp).
//
// What it refuses, before reading what follows (the connection is then closed):
//   400  a malformed request line or header line, a header line folded over two lines, a
//        Content-Length that is not a decimal number of at most 18 digits, two Content-Lengths
//        that differ, both Content-Length and Transfer-Encoding, a malformed chunk
//   411  a POST, PUT or PATCH with neither Content-Length nor chunked Transfer-Encoding
//   413  a body (Content-Length, or the chunks as they arrive) longer than max_body
//   414  a request line longer than max_line
//   415  a Content-Encoding other than identity (bodies are never inflated)
//   431  a header line longer than max_line, more than max_headers headers, a head over
//        max_head bytes (chunk trailers count as headers)
//   501  a Transfer-Encoding other than chunked
//   505  an HTTP version other than 1.0 and 1.1
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace treeattn::serve {

struct RequestLimits {
  std::size_t max_line = 8192;        // request line, header line, chunk-size line
  std::size_t max_headers = 100;      // header fields (and chunk trailers)
  std::size_t max_head = 16u << 10;   // request line + headers, bytes
  std::size_t max_body = 32u << 20;   // body bytes (de-chunked)
};

struct HttpRequest {
  std::string method, target, version;               // version: "HTTP/1.0" or "HTTP/1.1"
  std::vector<std::pair<std::string, std::string>> headers;  // as sent (values trimmed)
  std::string body;
  bool keep_alive = true;        // HTTP/1.1 without "Connection: close", 1.0 with keep-alive
  bool expect_continue = false;  // "Expect: 100-continue"
  bool chunked = false;

  // The first value of a header (names compare case-insensitively); empty when absent.
  std::string_view header(std::string_view name) const;
  bool has_header(std::string_view name) const;
  // The request as cpp-httplib reads it: request line, the headers less Content-Length,
  // Transfer-Encoding and Expect, "Content-Length: <body size>", the body.
  std::string normalized() const;
};

class RequestReader {
 public:
  enum class State {
    kHead,   // reading the request line and headers
    kHeadDone,  // the head is complete: call read_body() (or refuse the request)
    kBody,   // reading the body
    kDone,   // request() is complete
    kError,  // status() and message() say why
  };
  explicit RequestReader(RequestLimits limits = {}) : limits_(limits) {}

  // Consumes bytes of this request from the front of `data`; returns how many (the rest
  // belongs to the next request, or waits for a state change). Stops at kHeadDone.
  std::size_t feed(std::string_view data);
  // After kHeadDone: read the body next (kDone at once when there is none).
  void read_body();

  State state() const { return state_; }
  // Bytes of this request consumed so far (0: nothing of it has arrived).
  std::size_t consumed() const { return consumed_; }
  const HttpRequest& request() const { return req_; }
  HttpRequest& request() { return req_; }
  int status() const { return status_; }
  const std::string& message() const { return message_; }

 private:
  enum class Body { kNone, kLength, kChunkSize, kChunkData, kChunkDataEnd, kTrailers };
  void fail(int status, std::string message);
  // A complete line of the head or of the chunked framing; false: more bytes needed.
  bool take_line(std::string_view data, std::size_t& pos, std::string& line, int too_long,
                 const char* what);
  bool head_line(const std::string& line);
  bool trailer_line(const std::string& line);
  void finish_head();

  RequestLimits limits_;
  State state_ = State::kHead;
  Body body_ = Body::kNone;
  HttpRequest req_;
  std::string line_;          // the line being read
  bool got_request_line_ = false;
  std::size_t head_bytes_ = 0;
  std::size_t trailers_ = 0;
  uint64_t remaining_ = 0;    // of the Content-Length body or the current chunk
  std::size_t consumed_ = 0;
  int status_ = 0;
  std::string message_;
};

// The reason phrase of a status this server sends ("Bad Request", ...).
const char* reason_phrase(int status);

// CORS (`serve --cors-origins`): the headers ("Name: value") of a response to a request whose
// Origin header is `origin`. `allowed`: the origins allowed, "*" for any; none (the default), an
// empty origin (no Origin header) or one not listed: no headers. Access-Control-Allow-Origin is
// the origin itself when listed (with Vary: Origin) and "*" otherwise. A preflight (OPTIONS) also
// gets -Allow-Methods (GET, POST, OPTIONS), -Allow-Headers (Authorization, Content-Type and the
// ones its Access-Control-Request-Headers asks for, when that is a list of header names) and
// -Max-Age (a day).
std::vector<std::string> cors_headers(const std::vector<std::string>& allowed,
                                      std::string_view origin, bool preflight,
                                      std::string_view request_headers = {});

}  // namespace treeattn::serve
