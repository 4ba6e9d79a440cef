// Incremental detokenization, stop strings and a request's output (text.hpp).
#include "serve/text.hpp"

#include <algorithm>

namespace treeattn::serve {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Length of the UTF-8 sequence that lead byte c starts (RFC 3629), 0 for an invalid lead.
int sequence_length(unsigned char c) {
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return 2;
  if (c >= 0xE0 && c <= 0xEF) return 3;
  if (c >= 0xF0 && c <= 0xF4) return 4;
  return 0;
}

// Whether byte b may be the k-th byte (k >= 1) of a sequence that starts with lead.
bool valid_continuation(unsigned char lead, int k, unsigned char b) {
  if (k == 1) {
    if (lead == 0xE0) return b >= 0xA0 && b <= 0xBF;  // no overlong forms
    if (lead == 0xED) return b >= 0x80 && b <= 0x9F;  // no surrogates
    if (lead == 0xF0) return b >= 0x90 && b <= 0xBF;
    if (lead == 0xF4) return b >= 0x80 && b <= 0x8F;  // <= U+10FFFF
  }
  return b >= 0x80 && b <= 0xBF;
}

}  // namespace

std::string Utf8Assembler::push(std::string_view bytes) {
  pending_.append(bytes);
  std::string out;
  const std::size_t n = pending_.size();
  std::size_t i = 0;
  while (i < n) {
    const auto c = static_cast<unsigned char>(pending_[i]);
    const int len = sequence_length(c);
    if (len == 1) {
      out += static_cast<char>(c);
      ++i;
      continue;
    }
    if (len == 0) {
      out += kReplacement;
      ++i;
      continue;
    }
    int k = 1;
    while (k < len && i + k < n &&
           valid_continuation(c, k, static_cast<unsigned char>(pending_[i + k])))
      ++k;
    if (k == len) {
      out.append(pending_, i, static_cast<std::size_t>(len));
      i += static_cast<std::size_t>(len);
    } else if (i + k == n) {
      break;  // a valid start that has not ended yet: hold it back
    } else {
      out += kReplacement;  // the maximal invalid subpart becomes one U+FFFD
      i += static_cast<std::size_t>(k);
    }
  }
  pending_.erase(0, i);
  return out;
}

std::string Utf8Assembler::flush() {
  std::string out = pending_.empty() ? std::string() : std::string(kReplacement);
  pending_.clear();
  return out;
}

const char* finish_name(Finish f) {
  switch (f) {
    case Finish::kNone:
      return "none";
    case Finish::kStop:
      return "stop";
    case Finish::kLength:
      return "length";
    case Finish::kCancelled:
      return "cancelled";
    case Finish::kError:
      return "error";
    case Finish::kTimeout:
      return "timeout";
    case Finish::kToolCalls:
      return "tool_calls";
  }
  return "?";
}

Generation::Update Generation::on_event(const engine::TokenEvent& event) {
  Update u;
  if (done()) return u;
  timings_ = event.timings;
  auto emit = [&](StopMatcher::Out o) {
    u.text += o.text;
    if (o.stopped) {
      u.done = true;
      u.finish = Finish::kStop;
      u.stopped_by_string = true;
    }
  };
  if (event.token >= 0) {
    tokens_.push_back(event.token);
    // The stop token is not part of the text (engine.hpp).
    if (event.finish != engine::FinishReason::kStop) {
      if (logprobs_)
        held_logprobs_.push_back(
            {event.token, event.logprobs,
             static_cast<int64_t>(text_.size() + u.text.size() + stop_.held() + utf8_.held())});
      emit(stop_.push(utf8_.push(codec_->piece(event.token))));
    }
  }
  if (!u.done && event.finish != engine::FinishReason::kNone) {
    emit(stop_.push(utf8_.flush()));
    if (!u.done) {
      u.text += stop_.flush();
      u.done = true;
      switch (event.finish) {
        case engine::FinishReason::kStop:
          u.finish = Finish::kStop;
          break;
        case engine::FinishReason::kLength:
          u.finish = Finish::kLength;
          break;
        case engine::FinishReason::kCancelled:
          u.finish = Finish::kCancelled;
          u.error = "the request was cancelled (the server is stopping)";
          break;
        default:
          u.finish = Finish::kError;
          u.error = event.error.is_ok() ? std::string("the engine failed") : event.error.message();
          break;
      }
    }
  }
  if (u.done) {
    finish_ = u.finish;
    error_ = u.error;
  }
  text_ += u.text;
  release_logprobs(u);
  return u;
}

void Generation::release_logprobs(Update& u) {
  const bool all = u.done && !u.stopped_by_string;
  std::size_t n = 0;
  while (n < held_logprobs_.size() &&
         (all || held_logprobs_[n].text_offset < static_cast<int64_t>(text_.size())))
    ++n;
  u.logprobs.assign(held_logprobs_.begin(),
                    held_logprobs_.begin() + static_cast<std::ptrdiff_t>(n));
  sent_logprobs_.insert(sent_logprobs_.end(), u.logprobs.begin(), u.logprobs.end());
  held_logprobs_.erase(held_logprobs_.begin(),
                       held_logprobs_.begin() + static_cast<std::ptrdiff_t>(n));
  if (u.done) held_logprobs_.clear();
}

Generation::Update Generation::end(Finish finish) {
  Update u;
  if (done()) return u;
  const StopMatcher::Out o = stop_.push(utf8_.flush());
  u.text = o.text;
  if (!o.stopped) u.text += stop_.flush();
  u.done = true;
  u.finish = o.stopped ? Finish::kStop : finish;
  u.stopped_by_string = o.stopped;
  finish_ = u.finish;
  text_ += u.text;
  release_logprobs(u);
  return u;
}

}  // namespace treeattn::serve
