#include "backing/raw_io.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "backing/errors.h"
#include "backing/uring_file.h"

namespace statepager {

namespace {

// One direction: a file, its ring, and `depth` buffers cycling through it.
struct Stream {
  Stream(const std::string& path, bool create, bool write, uint64_t bytes, size_t block,
         unsigned depth)
      : file(path, UringFile::Options{depth, true, create}), write(write), bytes(bytes),
        block(block),
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
  // The files are created new (never someone else's) and deleted at the end, also when
  // the measurement fails.
  std::vector<std::string> created;
  struct Remove {
    std::vector<std::string>* paths;
    ~Remove() {
      for (const std::string& path : *paths) UringFile::remove_files(path);
    }
  } remove{&created};
  // Both files are written once untimed: the timed part then reads and overwrites blocks
  // that exist, as the store does from its second step on (first writes also pay for
  // block allocation, and on a VM for the host backing fresh guest memory).
  for (const std::string& path : {read_path, write_path}) {
    Stream fill(path, true, true, bytes, block, depth);
    created.push_back(path);
    fill.file.allocate(bytes);
    while (!fill.pump(1000)) {
    }
  }
  // Each direction on its own thread and ring, as two independent streams of requests.
  std::unique_ptr<Stream> reader, writer;
  if (read) reader = std::make_unique<Stream>(read_path, false, false, bytes, block, depth);
  if (write) writer = std::make_unique<Stream>(write_path, false, true, bytes, block, depth);
  const auto t0 = std::chrono::steady_clock::now();
  auto drive = [&](Stream* s, double* seconds, std::exception_ptr* error) {
    try {
      while (!s->pump(1000)) {
      }
    } catch (...) {
      *error = std::current_exception();
    }
    *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  double read_s = 0, write_s = 0;
  std::exception_ptr read_error, write_error;
  std::thread read_thread, write_thread;
  auto join = [&] {  // on every path: a joinable std::thread destroyed is std::terminate
    if (read_thread.joinable()) read_thread.join();
    if (write_thread.joinable()) write_thread.join();
  };
  try {
    if (read) read_thread = std::thread(drive, reader.get(), &read_s, &read_error);
    if (write) write_thread = std::thread(drive, writer.get(), &write_s, &write_error);
  } catch (...) {
    join();
    throw;
  }
  join();
  if (read_error) std::rethrow_exception(read_error);
  if (write_error) std::rethrow_exception(write_error);
  RawIoResult r;
  r.seconds = std::max(read_s, write_s);
  if (read) r.read_gbps = double(bytes) / read_s / 1e9;
  if (write) r.write_gbps = double(bytes) / write_s / 1e9;
  return r;
}

}  // namespace statepager
