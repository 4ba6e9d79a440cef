// Scheduler: see scheduler.hpp.
#include "engine/scheduler.hpp"

#include <algorithm>

namespace treeattn::engine {
namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

bool contains(const std::vector<RequestId>& ids, RequestId id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

std::vector<WorkItem> choose_work(const Running& running, int64_t prefill_chunk) {
  std::vector<WorkItem> work;
  int64_t budget = prefill_chunk;
  for (const auto& s : running) {
    const int64_t pending = static_cast<int64_t>(s->tokens.size()) - s->computed;
    if (s->computed >= s->prompt_len && pending == 1) {
      work.emplace_back(s->id, pending);
    } else if (budget > 0) {
      const int64_t n = std::min(pending, budget);
      budget -= n;
      work.emplace_back(s->id, n);
    }
  }
  return work;
}

bool prefix_in_flight(const Running& running, std::span<const TokenId> prompt,
                      const KVManager& kv) {
  if (!kv.prefix_cache()) return false;
  const int64_t T = kv.page_tokens();
  const int64_t reusable = kv.reusable_pages(static_cast<int64_t>(prompt.size()));
  for (const auto& s : running) {
    if (s->computed >= reusable * T) continue;  // what it shares is indexed already
    const int64_t limit = std::min<int64_t>(reusable * T, static_cast<int64_t>(s->tokens.size()));
    int64_t same = 0;
    while (same < limit &&
           s->tokens[static_cast<std::size_t>(same)] == prompt[static_cast<std::size_t>(same)])
      ++same;
    if (same / T * T > s->computed) return true;
  }
  return false;
}

// ---- the inbox ----------------------------------------------------------------------------------

Result<RequestId> Scheduler::submit(Request request, TokenCallback callback) {
  std::lock_guard lk(mu_);
  if (failed_) return internal_error("the engine failed: " + failure_.message());
  if (stop_now_ || stop_drain_) return internal_error("the engine is stopping");
  if (static_cast<int>(waiting_.size()) >= cfg_.max_queue)
    return Status(Code::kOutOfMemory,
                  "the request queue is full (" + std::to_string(waiting_.size()) + " waiting)");
  const RequestId id = next_id_++;
  waiting_.push_back({id, std::move(request), std::move(callback), Clock::now()});
  cv_.notify_all();
  return id;
}

void Scheduler::cancel(RequestId id) {
  std::lock_guard lk(mu_);
  cancel_ids_.push_back(id);
  cv_.notify_all();
}

void Scheduler::stop(bool drain) {
  std::lock_guard lk(mu_);
  if (drain)
    stop_drain_ = true;
  else
    stop_now_ = true;
  cv_.notify_all();
}

int64_t Scheduler::waiting() const {
  std::lock_guard lk(mu_);
  return static_cast<int64_t>(waiting_.size());
}

bool Scheduler::failed() const {
  std::lock_guard lk(mu_);
  return failed_;
}

Status Scheduler::failure() const {
  std::lock_guard lk(mu_);
  return failure_;
}

// ---- the replicated state -----------------------------------------------------------------------

Sequence* Scheduler::find(RequestId id) {
  for (auto& s : running_)
    if (s->id == id) return s.get();
  return nullptr;
}

void Scheduler::emit(Sequence& s, TokenEvent ev) {
  if (!s.cb) return;  // ranks other than 0 hold no callbacks
  ev.id = s.id;
  ev.timings.prompt_tokens = s.prompt_len;
  ev.timings.cached_tokens = s.cached_tokens;
  ev.timings.generated_tokens = s.generated;
  ev.timings.queue_seconds = seconds(s.admitted - s.submitted);
  if (s.generated > 0) {
    ev.timings.prefill_seconds = seconds(s.first_token - s.admitted);
    ev.timings.decode_seconds = seconds(Clock::now() - s.first_token);
  }
  s.cb(ev);
}

void Scheduler::retire(RequestId id) {
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    if ((*it)->id != id) continue;
    kv_.release(**it);
    running_.erase(it);
    return;
  }
}

bool Scheduler::known(RequestId id) {
  if (find(id) != nullptr) return true;
  return std::any_of(preempted_.begin(), preempted_.end(),
                     [&](const auto& s) { return s->id == id; });
}

void Scheduler::cancel_running(RequestId id) {
  TokenEvent ev;
  ev.finish = FinishReason::kCancelled;
  if (Sequence* s = find(id)) {
    emit(*s, ev);
    retire(id);
    return;
  }
  for (auto it = preempted_.begin(); it != preempted_.end(); ++it)
    if ((*it)->id == id) {
      emit(**it, ev);
      preempted_.erase(it);  // holds no pages
      return;
    }
}

void Scheduler::preempt(RequestId id) {
  for (auto it = running_.begin(); it != running_.end(); ++it) {
    if ((*it)->id != id) continue;
    kv_.preempt(**it);
    preempted_.insert(preempted_.begin(), std::move(*it));
    running_.erase(it);
    ++preemptions_total_;
    return;
  }
}

// Work items of the running sequences, in admission order; the most recently admitted one is
// preempted while the current item's pages do not fit (possibly the current one itself: then
// no later item is left). A lone sequence always fits: a request is refused when its positions
// exceed the pools (Engine::submit), and every other page is free or cached.
Status Scheduler::grow_running(Plan& pl) {
  const std::vector<WorkItem> items = choose_work(running_, cfg_.prefill_chunk);
  for (const auto& [id, n] : items) {
    Sequence* s = find(id);
    if (s == nullptr) break;  // preempted below
    const std::vector<int64_t> need = kv_.growth(*s, n);
    while (kv_.short_rank(need) >= 0) {
      if (running_.size() == 1)
        return internal_error(cfg_.who + "request " + std::to_string(id) + " needs " +
                              "pages beyond the KV pools with nothing left to preempt");
      const RequestId victim = running_.back()->id;
      pl.preempts.push_back(victim);
      preempt(victim);
      if (victim == id) break;
    }
    if (find(id) == nullptr) break;
    kv_.grow(*s, need);
  }
  return Status::ok();
}

Status Scheduler::apply_growth(const Plan& pl) {
  for (const auto& [id, n] : pl.work) {
    Sequence* s = find(id);
    if (s == nullptr) continue;  // admitted by this plan: its admission reserved its pages
    const std::vector<int64_t> need = kv_.growth(*s, n);
    const int r = kv_.short_rank(need);
    if (r >= 0)
      return internal_error(cfg_.who + "request " + std::to_string(id) +
                            "'s pages for this step do not fit rank " + std::to_string(r) +
                            " here: the replicated page tables diverged");
    kv_.grow(*s, need);
  }
  return Status::ok();
}

Result<bool> Scheduler::resume(bool decide) {
  Sequence& s = *preempted_.front();
  const AdmissionFit fit = kv_.fit(s.tokens);
  if (!fit.fits()) {
    if (decide) return false;
    return internal_error(cfg_.who + "request " + std::to_string(s.id) +
                          " resumed by rank 0 does not fit rank " +
                          std::to_string(fit.short_rank) +
                          "'s pages here: the replicated page tables diverged");
  }
  const int64_t cached = s.cached_tokens;  // of its prompt, as first admitted
  kv_.take(fit, s);
  s.cached_tokens = cached;
  running_.push_back(std::move(preempted_.front()));
  preempted_.erase(preempted_.begin());
  return true;
}

Result<bool> Scheduler::admit(RequestId id, Request req, bool decide, TokenCallback cb,
                              Clock::time_point submitted) {
  const AdmissionFit fit = kv_.fit(req.prompt);
  if (!fit.fits()) {
    if (decide) return false;
    return internal_error(
        cfg_.who + "request " + std::to_string(id) + " admitted by rank 0 does not fit rank " +
        std::to_string(fit.short_rank) + "'s pages here: the replicated page tables diverged");
  }
  auto s = std::make_unique<Sequence>();
  s->id = id;
  s->prompt_len = static_cast<int64_t>(req.prompt.size());
  s->tokens = req.prompt;
  s->sampler = model::Sampler(req.sampling);
  kv_.take(fit, *s);
  s->req = std::move(req);
  s->cb = std::move(cb);
  s->submitted = submitted;
  s->admitted = Clock::now();
  ++requests_total_;
  prompt_total_ += s->prompt_len;
  cached_total_ += s->cached_tokens;
  running_.push_back(std::move(s));
  return true;
}

std::vector<Scheduler::Pending> Scheduler::take_cancels(Plan& pl) {
  std::vector<Pending> dropped;
  std::unique_lock lk(mu_);
  if (running_.empty() && preempted_.empty() && waiting_.empty() && cancel_ids_.empty() &&
      !stop_now_ && !stop_drain_)
    cv_.wait_for(lk, cfg_.idle_tick);
  std::vector<RequestId> ids;
  ids.swap(cancel_ids_);
  for (RequestId id : ids) {
    auto it = std::find_if(waiting_.begin(), waiting_.end(),
                           [&](const Pending& pend) { return pend.id == id; });
    if (it != waiting_.end()) {
      dropped.push_back(std::move(*it));
      waiting_.erase(it);
    } else if (known(id) && !contains(pl.cancels, id)) {
      pl.cancels.push_back(id);
    }
  }
  if (stop_now_) {
    for (const Running* list : {&running_, &preempted_})
      for (const auto& s : *list)
        if (!contains(pl.cancels, s->id)) pl.cancels.push_back(s->id);
    for (Pending& pd : waiting_) dropped.push_back(std::move(pd));
    waiting_.clear();
    pl.kind = StepKind::kStop;
  }
  return dropped;
}

void Scheduler::drop(std::vector<Pending>& dropped, TokenEvent ev) {
  for (Pending& pd : dropped)
    if (pd.cb) {
      ev.id = pd.id;
      pd.cb(ev);
    }
}

// Admissions, first come first served: the first request that does not fit waits for pages
// rather than being overtaken. A request whose prompt shares full pages with a sequence still
// prefilling them waits until they are computed and indexed, then takes them from the prefix
// cache (requests behind it may go first meanwhile): otherwise N clients sending the same long
// document at once would prefill it N times, each at 1/N of the chunk budget.
Status Scheduler::admit_waiting(Plan& pl) {
  while (!preempted_.empty() && static_cast<int>(running_.size()) < cfg_.max_batch) {
    const RequestId id = preempted_.front()->id;
    auto ok = resume(true);
    TREEATTN_RETURN_IF_ERROR(ok.status());
    if (!*ok) return Status::ok();  // nothing overtakes a preempted sequence
    pl.resumes.push_back(id);
  }
  if (!preempted_.empty()) return Status::ok();
  for (std::size_t at = 0;;) {
    Pending pd;
    {
      std::lock_guard lk(mu_);
      if (at >= waiting_.size() || static_cast<int>(running_.size()) >= cfg_.max_batch) break;
      pd = waiting_[at];
    }
    if (prefix_in_flight(running_, pd.req.prompt, kv_)) {
      ++at;
      continue;
    }
    auto ok = admit(pd.id, pd.req, true, pd.cb, pd.submitted);
    TREEATTN_RETURN_IF_ERROR(ok.status());
    if (!*ok) break;
    {
      std::lock_guard lk(mu_);
      waiting_.erase(waiting_.begin() + static_cast<std::ptrdiff_t>(at));
    }
    pl.admits.push_back({pd.id, std::move(pd.req)});
  }
  return Status::ok();
}

// Cancel callbacks run outside the lock: a callback may call cancel() or submit().
Result<Plan> Scheduler::make_plan() {
  Plan pl;
  std::vector<Pending> dropped = take_cancels(pl);
  TokenEvent cancelled;
  cancelled.finish = FinishReason::kCancelled;
  drop(dropped, cancelled);
  for (RequestId id : pl.cancels) cancel_running(id);
  if (pl.kind == StepKind::kStop) return pl;
  TREEATTN_RETURN_IF_ERROR(grow_running(pl));
  TREEATTN_RETURN_IF_ERROR(admit_waiting(pl));
  pl.work = choose_work(running_, cfg_.prefill_chunk);
  std::lock_guard lk(mu_);
  pl.waiting_after = static_cast<int64_t>(waiting_.size() + preempted_.size());
  if (stop_drain_ && running_.empty() && waiting_.empty() && preempted_.empty())
    pl.kind = StepKind::kStop;
  return pl;
}

Status Scheduler::apply_plan(Plan& pl) {
  for (RequestId id : pl.cancels) cancel_running(id);
  for (RequestId id : pl.preempts) {
    if (find(id) == nullptr)
      return internal_error(cfg_.who + "step description preempts request " +
                            std::to_string(id) + ", which is not running here");
    preempt(id);
  }
  TREEATTN_RETURN_IF_ERROR(apply_growth(pl));
  for (RequestId id : pl.resumes) {
    if (preempted_.empty() || preempted_.front()->id != id)
      return internal_error(cfg_.who + "step description resumes request " +
                            std::to_string(id) + ", which is not the next preempted one here");
    auto ok = resume(false);
    TREEATTN_RETURN_IF_ERROR(ok.status());
  }
  for (auto& a : pl.admits) {
    auto ok = admit(a.id, std::move(a.req), false, {}, Clock::now());
    TREEATTN_RETURN_IF_ERROR(ok.status());
  }
  return Status::ok();
}

Status Scheduler::check_work(std::span<const WorkItem> work) {
  for (const auto& [id, n] : work) {
    Sequence* s = find(id);
    if (s == nullptr || n < 1 || s->computed + n > static_cast<int64_t>(s->tokens.size()))
      return internal_error(cfg_.who + "step description names request " + std::to_string(id) +
                            " with " + std::to_string(n) + " tokens, which this rank cannot run");
  }
  return Status::ok();
}

void Scheduler::fail_all(const Status& st) {
  std::deque<Pending> dq;
  {
    std::lock_guard lk(mu_);
    if (!failed_) {
      failed_ = true;
      failure_ = st;
    }
    dq.swap(waiting_);
  }
  TokenEvent ev;
  ev.finish = FinishReason::kError;
  ev.error = st;
  for (auto& s : running_) emit(*s, ev);
  for (auto& s : preempted_) emit(*s, ev);
  preempted_.clear();
  while (!running_.empty()) retire(running_.front()->id);
  std::vector<Pending> dropped(std::make_move_iterator(dq.begin()),
                               std::make_move_iterator(dq.end()));
  drop(dropped, ev);
}

void Scheduler::end_everything() {
  std::deque<Pending> dq;
  {
    std::lock_guard lk(mu_);
    dq.swap(waiting_);
    stop_now_ = true;
  }
  TokenEvent ev;
  ev.finish = FinishReason::kCancelled;
  for (const Running* list : {&running_, &preempted_})
    for (auto& s : *list) emit(*s, ev);
  running_.clear();
  preempted_.clear();
  std::vector<Pending> dropped(std::make_move_iterator(dq.begin()),
                               std::make_move_iterator(dq.end()));
  drop(dropped, ev);
}

}  // namespace treeattn::engine
