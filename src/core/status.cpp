// Status formatting.
#include "treeattn/status.hpp"

namespace treeattn {

const char* code_name(Code c) noexcept {
  switch (c) {
    case Code::kOk: return "ok";
    case Code::kInvalidArgument: return "invalid argument";
    case Code::kUnsupported: return "unsupported";
    case Code::kMismatch: return "mismatch across ranks";
    case Code::kTimeout: return "timeout";
    case Code::kNumerics: return "numerics";
    case Code::kInternal: return "internal error";
    case Code::kOutOfMemory: return "out of memory";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return std::string(code_name(code_)) + ": " + message_;
}

}  // namespace treeattn
