#include "backing/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace statepager {

void parallel_for(size_t n, unsigned threads, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;  // guards error
  std::exception_ptr error;
  auto work = [&] {
    try {
      for (size_t i; !failed.load() && (i = next.fetch_add(1)) < n;) fn(i);
    } catch (...) {
      failed.store(true);
      const std::lock_guard lock(mu);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < std::min<size_t>(threads, n); t++) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // no more threads to be had: those running (and this one) do the rest
    }
  }
  work();
  for (std::thread& t : helpers) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace statepager
