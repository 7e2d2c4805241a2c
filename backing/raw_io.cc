#include "backing/raw_io.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "backing/errors.h"
#include "backing/uring_file.h"

namespace statepager {

namespace {

// One direction: a file, its ring, and `depth` buffers cycling through it.
struct Stream {
  Stream(const std::string& path, bool write, uint64_t bytes, size_t block, unsigned depth)
      : file(path, UringFile::Options{depth, true}), write(write), bytes(bytes), block(block),
        buffers(static_cast<char*>(std::aligned_alloc(4096, size_t(depth) * block)), std::free) {
    std::memset(buffers.get(), 0x5a, size_t(depth) * block);
    for (unsigned i = 0; i < depth; i++) free_slots.push_back(i);
  }

  // Submits into every free slot; reaps what is done. Returns true when finished.
  bool pump(int64_t timeout_us) {
    while (!free_slots.empty() && next < bytes) {
      const unsigned slot = free_slots.back();
      free_slots.pop_back();
      const size_t len = size_t(std::min<uint64_t>(block, bytes - next));
      file.submit({slot, write, buffers.get() + size_t(slot) * block, len, next, -1});
      next += len;
    }
    done.clear();
    file.reap(&done, file.in_flight() > 0 ? timeout_us : 0);
    for (const auto& c : done) {
      if (c.error) throw_io_error(c.error, write ? "raw write" : "raw read", file.path(), c.offset);
      free_slots.push_back(unsigned(c.tag));
    }
    return next >= bytes && file.in_flight() == 0;
  }

  UringFile file;
  bool write;
  uint64_t bytes, next = 0;
  size_t block;
  std::unique_ptr<char, void (*)(void*)> buffers;
  std::vector<unsigned> free_slots;
  std::vector<UringFile::Completion> done;
};

}  // namespace

RawIoResult measure_raw_io(const std::string& dir, uint64_t bytes, size_t block, unsigned depth,
                           bool read, bool write) {
  bytes = (bytes + 4095) / 4096 * 4096;
  const std::string read_path = dir + "/raw-read.bin", write_path = dir + "/raw-write.bin";
  if (read) {
    Stream fill(read_path, true, bytes, block, depth);
    fill.file.allocate(bytes);
    while (!fill.pump(1000)) {
    }
  }
  std::unique_ptr<Stream> reader, writer;
  if (read) reader = std::make_unique<Stream>(read_path, false, bytes, block, depth);
  if (write) {
    writer = std::make_unique<Stream>(write_path, true, bytes, block, depth);
    writer->file.allocate(bytes);
  }
  const auto t0 = std::chrono::steady_clock::now();
  double read_s = 0, write_s = 0;
  bool read_done = !read, write_done = !write;
  while (!read_done || !write_done) {
    // With both directions active neither may block for long, or the other starves.
    const int64_t wait_us = (read_done || write_done) ? 1000 : 50;
    const double now = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!read_done && reader->pump(wait_us)) read_done = true, read_s = now;
    if (!write_done && writer->pump(wait_us)) write_done = true, write_s = now;
  }
  RawIoResult r;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (read) r.read_gbps = double(bytes) / (read_s > 0 ? read_s : r.seconds) / 1e9;
  if (write) r.write_gbps = double(bytes) / (write_s > 0 ? write_s : r.seconds) / 1e9;
  reader.reset();
  writer.reset();
  ::unlink(read_path.c_str());
  ::unlink(write_path.c_str());
  return r;
}

}  // namespace statepager
