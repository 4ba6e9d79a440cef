// From generated token ids to the text a client receives: bytes to whole UTF-8 characters,
// stop strings, and the state of one request's output (Generation). Pure; unit-tested.
//
// A token is a run of bytes that may end inside a UTF-8 character (byte-level BPE splits rare
// characters over several tokens). Utf8Assembler hands out only whole, valid characters and
// holds back at most 3 bytes; an invalid byte becomes U+FFFD, so every text that leaves the
// server is valid UTF-8 (JSON needs it).
//
// Stop strings: StopMatcher holds back the end of the text while it may be the start of a stop
// string ("Hel" while "Hello" is a stop string), so a client never sees part of one. When one
// appears, the text before it is the last text of the request; the stop string and whatever
// follows are dropped (OpenAI's behaviour), and the caller cancels the request in the engine.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "serve/api.hpp"
#include "treeattn/engine.hpp"
#include "treeattn/tokenizer.hpp"

namespace treeattn::serve {

class Utf8Assembler {
 public:
  // The whole characters of what came so far; an incomplete one at the end is kept.
  std::string push(std::string_view bytes);
  // What is held back (an incomplete character: U+FFFD).
  std::string flush();
  std::size_t held() const { return pending_.size(); }

 private:
  std::string pending_;
};

// Stop strings (tokenizer.hpp): the server's and `treeattn generate`'s.
using treeattn::StopMatcher;

// kTimeout: the request's deadline (its "timeout" field or the server's --request-timeout)
// passed; its answer is the text so far with finish_reason "timeout". kToolCalls: the answer
// ended and holds tool calls (tool_calls.hpp); the server sets it, Generation never does.
enum class Finish { kNone, kStop, kLength, kCancelled, kError, kTimeout, kToolCalls };
const char* finish_name(Finish f);  // OpenAI's finish_reason: "stop", "length"; else the name

// A generated token's log-probabilities (engine::Request::logprobs) and the byte offset of its
// text in the output.
struct TokenLogprob {
  TokenId token = -1;
  model::TokenLogprobs lp;
  int64_t text_offset = 0;
};

// One request's output, fed with the engine's events in order. With `logprobs`, it keeps each
// token's TokenLogprob, except the stop token that ends the generation, and hands them out
// with the text: a token's goes out once the text sent has passed its offset, the rest at the
// end, except those of a stop string's tokens (at or past where the text was cut).
class Generation {
 public:
  Generation(const Codec& codec, std::vector<std::string> stop, bool logprobs = false)
      : codec_(&codec), stop_(std::move(stop)), logprobs_(logprobs) {}

  struct Update {
    std::string text;  // new text to send (may be empty)
    std::vector<TokenLogprob> logprobs;  // the tokens' whose text this update passes
    bool done = false;
    Finish finish = Finish::kNone;
    bool stopped_by_string = false;  // the caller cancels the request in the engine
    std::string error;               // kError / kCancelled: why
  };
  // Events after the request is done (the engine's cancel after a stop string) are ignored.
  Update on_event(const engine::TokenEvent& event);
  // Ends the output here (the server ended the request: its deadline): the text held back
  // (a partial UTF-8 character, a possible stop string's start) goes out.
  Update end(Finish finish);

  bool done() const { return finish_ != Finish::kNone; }
  Finish finish() const { return finish_; }
  const std::string& error() const { return error_; }             // kError / kCancelled: why
  const std::string& text() const { return text_; }               // everything sent so far
  const std::vector<TokenId>& tokens() const { return tokens_; }  // generated, stop token too
  const std::vector<TokenLogprob>& logprobs() const { return sent_logprobs_; }  // handed out
  int64_t completion_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  const engine::RequestTimings& timings() const { return timings_; }

 private:
  const Codec* codec_;
  Utf8Assembler utf8_;
  StopMatcher stop_;
  std::string text_;
  std::vector<TokenId> tokens_;
  engine::RequestTimings timings_;
  Finish finish_ = Finish::kNone;
  std::string error_;
  bool logprobs_ = false;
  std::vector<TokenLogprob> held_logprobs_, sent_logprobs_;
  void release_logprobs(Update& u);
};

}  // namespace treeattn::serve
