// Work split into units, claimed a few at a time from a shared counter by the calling thread and
// by tasks on XLA's intra-op pool (the FFI ThreadPool). The caller waits only for units another
// thread has claimed, so a task the pool runs late (or never) costs nothing and nothing can
// deadlock. Used by both CPU kernels (int4_matvec.cc, paged_attention.cc).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

// fn(u0, u1) over units [0, units), claims of ceil(units / (threads * claims_per_thread)) units;
// on the pool's other threads too when `parallel`. Returns when every unit is done; fn runs only
// before that (a late task finds nothing left to claim).
inline void run_claims(xla::ffi::ThreadPool& pool, int64_t units, bool parallel, int64_t claims_per_thread,
                       const std::function<void(int64_t, int64_t)>& fn) {
  struct State {
    std::function<void(int64_t, int64_t)> fn;
    int64_t units, per_claim;
    std::atomic<int64_t> next{0}, done{0};
    void work() {
      for (;;) {
        const int64_t u0 = next.fetch_add(per_claim);
        if (u0 >= units) return;
        const int64_t u1 = std::min(units, u0 + per_claim);
        fn(u0, u1);
        done.fetch_add(u1 - u0, std::memory_order_release);
      }
    }
  };
  auto st = std::make_shared<State>();
  st->fn = fn;
  st->units = units;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  parallel = parallel && threads > 1 && units > 1;
  const int64_t claims = threads * claims_per_thread;
  st->per_claim = parallel ? std::max<int64_t>(1, (units + claims - 1) / claims) : std::max<int64_t>(1, units);
  if (parallel)
    for (int64_t t = 1; t < threads; ++t) pool.Schedule([st] { st->work(); });
  st->work();
  while (st->done.load(std::memory_order_acquire) < units) std::this_thread::yield();
}

}  // namespace jaxserve
