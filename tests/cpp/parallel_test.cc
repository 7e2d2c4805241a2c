// parallel_for: every index once, in threads; the first error stops the rest and is
// rethrown after all have joined.
#include "backing/parallel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

namespace statepager {
namespace {

TEST(ParallelFor, RunsEveryIndexOnceOnSeveralThreads) {
  std::vector<std::atomic<int>> runs(1000);
  std::atomic<int> busy{0}, most{0};
  parallel_for(runs.size(), 4, [&](size_t i) {
    const int now = ++busy;
    for (int seen = most.load(); now > seen && !most.compare_exchange_weak(seen, now);) {}
    std::this_thread::yield();
    runs[i]++;
    --busy;
  });
  for (auto& r : runs) EXPECT_EQ(r.load(), 1);
  EXPECT_LE(most.load(), 4);
  parallel_for(0, 4, [](size_t) { FAIL() << "no index to run"; });
}

TEST(ParallelFor, FirstErrorStopsTheRestAndIsRethrown) {
  // Items take 100 us, so that the rest (0.1 s per thread) outlast the throw by far
  // even on a loaded machine: an error that did not stop them would let them all run.
  std::atomic<int> ran{0};
  EXPECT_THROW(parallel_for(2000, 3,
                            [&](size_t i) {
                              if (i == 5) throw std::runtime_error("item 5");
                              std::this_thread::sleep_for(std::chrono::microseconds(100));
                              ran++;
                            }),
               std::runtime_error);
  EXPECT_LT(ran.load(), 1000);  // most later indices were never taken
}

}  // namespace
}  // namespace statepager
