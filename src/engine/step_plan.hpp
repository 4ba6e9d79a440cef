// One engine step's description (what rank 0 decided: cancels, admissions, the work of each
// sequence) and its wire format: int64 words that rank 0 broadcasts and every other rank decodes
// and applies, so that every rank's replicated state changes the same way.
//
// Words: kind, waiting_after, #cancels, #preempts, #resumes, #admits, #work; the cancels',
// preemptions' and resumptions' ids; each admission (id, #prompt, max_new_tokens, temperature
// bits, top_k, top_p bits, seed, min_p bits, presence_penalty bits, frequency_penalty bits,
// repetition_penalty bits, return_logits, logprobs, #stop tokens, #logit_bias entries, the stop
// tokens, the logit_bias entries (id, bias bits), the prompt, the response format's byte count
// and its bytes, eight a word, little-endian); each work item (id, tokens). Every rank applies
// them in that order: cancels, preemptions, the running sequences' page growth for their work,
// resumptions, admissions.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "treeattn/engine.hpp"
#include "treeattn/status.hpp"

namespace treeattn::engine {

enum class StepKind : int64_t {
  kRun = 1,
  kStop = 2,
  kFail = 3,  // rank 0 could not plan: every rank ends with an error
};

// The fewest words of a description: its header.
inline constexpr std::size_t kPlanHeaderWords = 7;

using WorkItem = std::pair<RequestId, int64_t>;  // a sequence and its tokens this step

struct Plan {
  StepKind kind = StepKind::kRun;
  int64_t waiting_after = 0;  // requests still queued after this step's admissions
  std::vector<RequestId> cancels;
  std::vector<RequestId> preempts;  // running sequences preempted, in order
  std::vector<RequestId> resumes;   // preempted sequences admitted again, in order
  struct Admit {
    RequestId id = 0;
    Request req;
  };
  std::vector<Admit> admits;
  std::vector<WorkItem> work;
};

std::vector<int64_t> encode_plan(const Plan& plan);

// kInternal "malformed step description from rank 0 (word i of n): why" for a truncated
// description, trailing words, an unknown kind, or a count or length outside what the words
// can hold; never reads past the words.
Result<Plan> decode_plan(std::span<const int64_t> words);

}  // namespace treeattn::engine
