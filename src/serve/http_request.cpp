// The HTTP/1.x request reader (http_request.hpp).
#include "serve/http_request.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>

namespace treeattn::serve {
namespace {

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// RFC 9110 token characters (method and header names).
bool is_tchar(unsigned char c) {
  return std::isalnum(c) != 0 || std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

bool is_token(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return c != '\0' && is_tchar(static_cast<unsigned char>(c));
  });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// The comma-separated list `value` contains `item` (case-insensitively).
bool list_contains(std::string_view value, std::string_view item) {
  while (!value.empty()) {
    const auto comma = value.find(',');
    if (iequals(trim(value.substr(0, comma)), item)) return true;
    if (comma == std::string_view::npos) break;
    value.remove_prefix(comma + 1);
  }
  return false;
}

// A field value's characters: visible ASCII, obs-text, space and tab (no CR, LF, NUL or other
// controls).
bool is_field_value(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c == '\t' || (c >= 0x20 && c != 0x7f);
  });
}

// At most 64 bytes of `s`, printable ASCII only (for an error message, which is JSON).
std::string printable(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 64)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  return out;
}

}  // namespace

std::string_view HttpRequest::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (iequals(k, name)) return v;
  return {};
}

bool HttpRequest::has_header(std::string_view name) const {
  return std::any_of(headers.begin(), headers.end(),
                     [&](const auto& kv) { return iequals(kv.first, name); });
}

std::string HttpRequest::normalized() const {
  std::string out;
  out.reserve(target.size() + body.size() + 64 * (headers.size() + 1));
  out += method + " " + target + " " + version + "\r\n";
  for (const auto& [k, v] : headers) {
    if (iequals(k, "Content-Length") || iequals(k, "Transfer-Encoding") || iequals(k, "Expect"))
      continue;
    out += k + ": " + v + "\r\n";
  }
  out += "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n";
  out += body;
  return out;
}

void RequestReader::fail(int status, std::string message) {
  state_ = State::kError;
  status_ = status;
  message_ = std::move(message);
}

bool RequestReader::take_line(std::string_view data, std::size_t& pos, std::string& line,
                              int too_long, const char* what) {
  const std::size_t nl = data.find('\n', pos);
  const std::size_t end = nl == std::string_view::npos ? data.size() : nl;
  const std::size_t room = limits_.max_line + 2 - std::min(line_.size(), limits_.max_line + 2);
  line_.append(data.substr(pos, std::min(end - pos, room)));
  if (line_.size() > limits_.max_line + 1) {  // + 1: the CR of CRLF
    pos = std::min(end, pos + room);
    fail(too_long, std::string(what) + " is longer than " + std::to_string(limits_.max_line) +
                       " bytes.");
    return false;
  }
  if (nl == std::string_view::npos) {
    pos = data.size();
    return false;
  }
  pos = nl + 1;
  line.swap(line_);
  line_.clear();
  if (!line.empty() && line.back() == '\r') line.pop_back();
  if (line.find('\r') != std::string::npos) {
    fail(400, std::string(what) + " contains a bare CR.");
    return false;
  }
  return true;
}

bool RequestReader::head_line(const std::string& line) {
  if (!got_request_line_) {
    if (line.empty()) return true;  // empty lines before a request line are ignored (RFC 9112)
    const auto s1 = line.find(' ');
    const auto s2 = s1 == std::string::npos ? s1 : line.find(' ', s1 + 1);
    if (s2 == std::string::npos || line.find(' ', s2 + 1) != std::string::npos) {
      fail(400, "Malformed HTTP request line.");
      return false;
    }
    req_.method = line.substr(0, s1);
    req_.target = line.substr(s1 + 1, s2 - s1 - 1);
    req_.version = line.substr(s2 + 1);
    const bool target_ok =
        !req_.target.empty() && std::all_of(req_.target.begin(), req_.target.end(), [](char c) {
          const auto u = static_cast<unsigned char>(c);
          return u > 0x20 && u != 0x7f;
        });
    if (!is_token(req_.method) || !target_ok) {
      fail(400, "Malformed HTTP request line.");
      return false;
    }
    if (req_.version != "HTTP/1.1" && req_.version != "HTTP/1.0") {
      fail(req_.version.rfind("HTTP/", 0) == 0 ? 505 : 400,
           "HTTP version not supported (HTTP/1.0 and HTTP/1.1 are).");
      return false;
    }
    got_request_line_ = true;
    return true;
  }
  if (line.empty()) {
    finish_head();
    return state_ != State::kError;
  }
  if (line.front() == ' ' || line.front() == '\t') {
    fail(400, "Folded header lines are not accepted.");
    return false;
  }
  const auto colon = line.find(':');
  if (colon == std::string::npos || !is_token(std::string_view(line).substr(0, colon))) {
    fail(400, "Malformed header line.");
    return false;
  }
  const std::string_view value = trim(std::string_view(line).substr(colon + 1));
  if (!is_field_value(value)) {
    fail(400, "Malformed header value.");
    return false;
  }
  if (req_.headers.size() >= limits_.max_headers) {
    fail(431, "More than " + std::to_string(limits_.max_headers) + " header fields.");
    return false;
  }
  req_.headers.emplace_back(line.substr(0, colon), std::string(value));
  return true;
}

void RequestReader::finish_head() {
  state_ = State::kHeadDone;
  const bool v11 = req_.version == "HTTP/1.1";
  const std::string_view connection = req_.header("Connection");
  req_.keep_alive = v11 ? !list_contains(connection, "close") : list_contains(connection, "keep-alive");
  req_.expect_continue = iequals(req_.header("Expect"), "100-continue");

  // Content-Length: one decimal value (repeats must agree).
  std::string length;
  for (const auto& [k, v] : req_.headers) {
    if (!iequals(k, "Content-Length")) continue;
    if (v.empty() || v.size() > 18 ||
        !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      fail(400, "Invalid Content-Length: " + printable(v));
      return;
    }
    if (!length.empty() && std::stoull(length) != std::stoull(v)) {
      fail(400, "Conflicting Content-Length headers.");
      return;
    }
    length = v;
  }
  std::string te;
  for (const auto& [k, v] : req_.headers)
    if (iequals(k, "Transfer-Encoding")) te += (te.empty() ? "" : ",") + v;
  if (!te.empty()) {
    if (!length.empty()) {
      fail(400, "Both Content-Length and Transfer-Encoding.");
      return;
    }
    if (!iequals(trim(te), "chunked")) {
      fail(501, "Transfer-Encoding " + printable(trim(te)) +
                    " is not supported (chunked is).");
      return;
    }
    if (!v11) {
      fail(400, "Transfer-Encoding in an HTTP/1.0 request.");
      return;
    }
    req_.chunked = true;
  }
  const std::string_view encoding = trim(req_.header("Content-Encoding"));
  if (req_.has_header("Content-Encoding") && !iequals(encoding, "identity")) {
    fail(415, "Content-Encoding " + printable(encoding) +
                  " is not supported: send the body uncompressed.");
    return;
  }
  if (!length.empty()) {
    remaining_ = std::stoull(length);
    if (remaining_ > limits_.max_body) {
      fail(413, "The request body is larger than " + std::to_string(limits_.max_body) + " bytes.");
      return;
    }
    body_ = remaining_ > 0 ? Body::kLength : Body::kNone;
  } else if (req_.chunked) {
    body_ = Body::kChunkSize;
  } else {
    const std::string m = lower(req_.method);
    if (m == "post" || m == "put" || m == "patch") {
      fail(411, "A request body needs a Content-Length (or Transfer-Encoding: chunked).");
      return;
    }
    body_ = Body::kNone;
  }
}

void RequestReader::read_body() {
  if (state_ != State::kHeadDone) return;
  state_ = body_ == Body::kNone ? State::kDone : State::kBody;
  if (body_ == Body::kLength) req_.body.reserve(static_cast<std::size_t>(remaining_));
}

bool RequestReader::trailer_line(const std::string& line) {
  if (line.empty()) {
    state_ = State::kDone;
    return false;
  }
  if (++trailers_ + req_.headers.size() > limits_.max_headers) {
    fail(431, "More than " + std::to_string(limits_.max_headers) + " header fields.");
    return false;
  }
  return true;  // trailers are read and dropped
}

std::size_t RequestReader::feed(std::string_view data) {
  std::size_t pos = 0;
  std::string line;
  while (pos < data.size() && (state_ == State::kHead || state_ == State::kBody)) {
    if (state_ == State::kHead) {
      const std::size_t before = pos;
      const bool got = take_line(data, pos, line, got_request_line_ ? 431 : 414,
                                 got_request_line_ ? "A header line" : "The request line");
      head_bytes_ += pos - before;
      if (state_ == State::kError) break;
      // Checked per complete line (a line is bounded by max_line meanwhile), so that the
      // refusal does not depend on how the bytes arrived.
      if (got && head_bytes_ > limits_.max_head) {
        fail(431, "The request head is larger than " + std::to_string(limits_.max_head) +
                      " bytes.");
        break;
      }
      if (!got || !head_line(line)) break;
      continue;
    }
    switch (body_) {
      case Body::kNone:
        state_ = State::kDone;
        break;
      case Body::kLength:
      case Body::kChunkData: {
        const std::size_t n =
            static_cast<std::size_t>(std::min<uint64_t>(remaining_, data.size() - pos));
        req_.body.append(data.substr(pos, n));
        pos += n;
        remaining_ -= n;
        if (remaining_ == 0) {
          if (body_ == Body::kLength)
            state_ = State::kDone;
          else
            body_ = Body::kChunkDataEnd;
        }
        break;
      }
      case Body::kChunkDataEnd:
        if (!take_line(data, pos, line, 400, "A chunk's end")) break;
        if (!line.empty()) {
          fail(400, "Malformed chunked body: a chunk's data is longer than its size.");
          break;
        }
        body_ = Body::kChunkSize;
        break;
      case Body::kChunkSize: {
        if (!take_line(data, pos, line, 400, "A chunk-size line")) break;
        const std::string_view size = trim(std::string_view(line).substr(0, line.find(';')));
        uint64_t n = 0;
        if (size.empty() || size.size() > 15 ||
            !std::all_of(size.begin(), size.end(),
                         [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); })) {
          fail(400, "Malformed chunked body: a chunk size is not a hexadecimal number.");
          break;
        }
        for (char c : size)
          n = n * 16 + static_cast<uint64_t>(std::isdigit(static_cast<unsigned char>(c))
                                                 ? c - '0'
                                                 : std::tolower(static_cast<unsigned char>(c)) -
                                                       'a' + 10);
        if (n > limits_.max_body - req_.body.size()) {
          fail(413,
               "The request body is larger than " + std::to_string(limits_.max_body) + " bytes.");
          break;
        }
        remaining_ = n;
        body_ = n == 0 ? Body::kTrailers : Body::kChunkData;
        break;
      }
      case Body::kTrailers:
        if (!take_line(data, pos, line, 431, "A trailer line")) break;
        trailer_line(line);
        break;
    }
  }
  consumed_ += pos;
  return pos;
}

const char* reason_phrase(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Payload Too Large";
    case 414: return "URI Too Long";
    case 415: return "Unsupported Media Type";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

std::vector<std::string> cors_headers(const std::vector<std::string>& allowed,
                                      std::string_view origin, bool preflight,
                                      std::string_view request_headers) {
  if (allowed.empty() || origin.empty()) return {};
  std::vector<std::string> out;
  if (std::find(allowed.begin(), allowed.end(), origin) != allowed.end()) {
    out.push_back("Access-Control-Allow-Origin: " + std::string(origin));
    out.push_back("Vary: Origin");
  } else if (std::find(allowed.begin(), allowed.end(), "*") != allowed.end()) {
    out.push_back("Access-Control-Allow-Origin: *");
  } else {
    return {};
  }
  if (!preflight) return out;
  out.push_back("Access-Control-Allow-Methods: GET, POST, OPTIONS");
  std::string headers = "Authorization, Content-Type";
  // The headers asked for, when they are names (letters, digits, '-', '_') in a short list.
  const bool names = request_headers.size() <= 1024 &&
                     std::all_of(request_headers.begin(), request_headers.end(), [](char c) {
                       return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '-' ||
                              c == '_' || c == ',' || c == ' ' || c == '\t';
                     });
  if (names) {
    std::size_t pos = 0;
    while (pos < request_headers.size()) {
      std::size_t end = request_headers.find(',', pos);
      if (end == std::string_view::npos) end = request_headers.size();
      std::string_view h = request_headers.substr(pos, end - pos);
      pos = end + 1;
      while (!h.empty() && (h.front() == ' ' || h.front() == '\t')) h.remove_prefix(1);
      while (!h.empty() && (h.back() == ' ' || h.back() == '\t')) h.remove_suffix(1);
      if (h.empty() || h.find_first_of(" \t") != std::string_view::npos) continue;
      auto same = [&](std::string_view known) {
        return known.size() == h.size() &&
               std::equal(h.begin(), h.end(), known.begin(), [](char a, char b) {
                 return std::tolower(static_cast<unsigned char>(a)) ==
                        std::tolower(static_cast<unsigned char>(b));
               });
      };
      if (!same("Authorization") && !same("Content-Type")) headers += ", " + std::string(h);
    }
  }
  out.push_back("Access-Control-Allow-Headers: " + headers);
  out.push_back("Access-Control-Max-Age: 86400");
  return out;
}

}  // namespace treeattn::serve
