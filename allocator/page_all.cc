#include "allocator/page_all.h"

#include <exception>

#include "backing/errors.h"

namespace statepager {

void page_all(Pager& pager, const std::vector<ExtentId>& ids, size_t bucket_size, bool out) {
  if (bucket_size == 0) throw UsageError("bucket_size must be at least 1 byte");
  std::vector<Ticket> tickets;
  std::exception_ptr error;
  try {
    std::vector<ExtentId> bucket;
    size_t bytes = 0;
    auto submit = [&] {
      if (!bucket.empty()) tickets.push_back(out ? pager.page_out(bucket) : pager.page_in(bucket));
      bucket.clear();
      bytes = 0;
    };
    for (ExtentId id : ids) {
      if (!pager.exists(id)) continue;
      bucket.push_back(id);
      bytes += pager.size(id);
      if (bytes >= bucket_size) submit();
    }
    submit();
  } catch (...) {
    error = std::current_exception();
  }
  for (const Ticket& t : tickets) {
    try {
      pager.wait(t);
    } catch (...) {
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace statepager
