#include "allocator/ram_map.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "backing/errors.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace statepager {

RamMap::RamMap(Device& device, UringFile& file) : device_(device), file_(file) {}

RamMap::~RamMap() {
  for (Physical& p : physical_) {
    for (const Mapping& m : p.maps) {
      try {
        device_.unregister_host(m.host);
      } catch (...) {  // a failed device: the mapping goes all the same
      }
      ::munmap(m.host, m.bytes);
    }
  }
}

RamMap::Physical& RamMap::physical_locked(unsigned index) {
  if (index >= physical_.size()) physical_.resize(index + 1);
  Physical& p = physical_[index];
  if (p.fd < 0) {
    p.fd = file_.physical_fd(index);
    p.path = file_.physical_paths().at(index);
  }
  return p;
}

void RamMap::grow(unsigned file) {
  const UringFile::Physical files = file_.physical_of(file);
  if (!files.ram) return;
  for (unsigned k = files.first; k < files.first + files.count; ++k) grow_one(k);
}

// Maps [end, the file's size rounded down to a page) in one mapping: populated first, so
// that a full filesystem fails here (ENOSPC as an error, not a SIGBUS on first touch),
// then registered; mu_ is let go meanwhile (seconds for gigabytes).
void RamMap::grow_one(unsigned index) {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::unique_lock lock(mu_);
  Physical& p = physical_locked(index);
  struct stat st;
  if (::fstat(p.fd, &st) != 0) throw_io_error(errno, "fstat", p.path, 0);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < p.end) {
    throw CorruptStoreError("store file " + p.path + " holds " + std::to_string(size) +
                            " bytes, fewer than the " + std::to_string(p.end) +
                            " statepager wrote: it was cut short outside statepager, and "
                            "the state it held is lost");
  }
  const uint64_t from = p.end, to = size / page * page;
  if (p.stopped || to <= from) return;
  const int fd = p.fd;
  p.growing = true;
  lock.unlock();
  const size_t bytes = to - from;
  void* host = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
                      static_cast<off_t>(from));
  bool ok = host != MAP_FAILED;
  if (ok && (::madvise(host, bytes, MADV_POPULATE_WRITE) != 0 ||
             !device_.register_host(host, bytes))) {
    ::munmap(host, bytes);
    ok = false;
  }
  lock.lock();
  Physical& q = physical_[index];  // physical_ may have grown meanwhile (punch() does not)
  q.growing = false;
  if (!ok) {
    q.stopped = true;
    return;
  }
  q.maps.push_back(Mapping{from, bytes, static_cast<char*>(host)});
  q.end = to;
}

bool RamMap::resolve(uint64_t offset, size_t bytes, std::vector<Piece>* out) const {
  std::vector<Piece> found;
  std::lock_guard lock(mu_);
  if (physical_.empty()) return false;  // no store in RAM: asked each round, answered fast
  for (const UringFile::Span& s : file_.spans(offset, bytes)) {
    if (s.file >= physical_.size() || s.offset + s.length > physical_[s.file].end) return false;
    const std::vector<Mapping>& maps = physical_[s.file].maps;
    // The mapping holding s.offset, then those after it while the span goes on.
    auto m = std::upper_bound(maps.begin(), maps.end(), s.offset,
                              [](uint64_t at, const Mapping& x) { return at < x.offset; }) - 1;
    for (uint64_t at = s.offset, end = s.offset + s.length; at < end; ++m) {
      const uint64_t n = std::min(end, m->offset + m->bytes) - at;
      found.push_back(Piece{m->host + (at - m->offset), n, m->host});
      at += n;
    }
  }
  out->insert(out->end(), found.begin(), found.end());
  return true;
}

void RamMap::punch(uint64_t offset, uint64_t length) {
  const unsigned file = static_cast<unsigned>(offset / UringFile::kRegionBytes);
  const UringFile::Physical files = file_.physical_of(file);
  std::lock_guard lock(mu_);
  for (unsigned k = files.first; k < files.first + files.count; ++k) {
    if (k < physical_.size() && (physical_[k].growing || !physical_[k].maps.empty())) return;
  }
  file_.punch(offset, length);
}

uint64_t RamMap::mapped_bytes() const {
  std::lock_guard lock(mu_);
  uint64_t total = 0;
  for (const Physical& p : physical_) total += p.end;
  return total;
}

}  // namespace statepager
