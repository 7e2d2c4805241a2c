#include "allocator/job.h"

namespace statepager {

std::pair<double, double> job_times(const Job& job) {
  auto seconds = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(t.time_since_epoch()).count();
  };
  return {seconds(job.start_time), seconds(job.end_time)};
}

}  // namespace statepager
