// The serving engine as the HTTP server's Backend (header-only: only `treeattn serve` links the
// engine).
#pragma once

#include "serve/server.hpp"
#include "treeattn/engine.hpp"

namespace treeattn::serve {

class EngineBackend final : public Backend {
 public:
  explicit EngineBackend(engine::Engine& engine) : engine_(engine) {}
  Result<engine::RequestId> submit(engine::Request request,
                                   engine::TokenCallback callback) override {
    return engine_.submit(std::move(request), std::move(callback));
  }
  void cancel(engine::RequestId id) override { engine_.cancel(id); }
  engine::EngineMetrics metrics() const override { return engine_.metrics(); }
  int64_t max_sequence_tokens() const override { return engine_.max_sequence_tokens(); }
  int64_t progress() const override { return engine_.progress(); }

 private:
  engine::Engine& engine_;
};

}  // namespace treeattn::serve
