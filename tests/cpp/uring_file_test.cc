#include "backing/uring_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "backing/errors.h"
#include "tests/cpp/temp_dir.h"

namespace statepager {
namespace {

constexpr size_t kPage = UringFile::kAlignment;


struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<char, FreeDeleter>;

AlignedBuf aligned_buf(size_t bytes) {
  return AlignedBuf(static_cast<char*>(std::aligned_alloc(kPage, bytes)));
}

void fill_random(char* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = rng();
    std::memcpy(p + i, &v, std::min<size_t>(8, n - i));
  }
}

// Whether `dir` accepts O_DIRECT, found independently of UringFile.
bool filesystem_accepts_direct(const std::string& dir) {
  const std::string path = dir + "/direct_probe";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0644);
  if (fd < 0) return false;
  AlignedBuf block = aligned_buf(kPage);
  std::memset(block.get(), 0, kPage);
  const bool ok = ::pwrite(fd, block.get(), kPage, 0) == static_cast<ssize_t>(kPage);
  ::close(fd);
  ::unlink(path.c_str());
  return ok;
}

// Runs `fn` in a forked child and returns its exit code (fn's result, 99 on an exception,
// 128 + signal when killed). Rings and files are created inside the child.
int run_in_child(const std::function<int()>& fn) {
  pid_t pid = ::fork();
  if (pid == 0) {
    int code = 99;
    try {
      code = fn();
    } catch (...) {
    }
    ::_exit(code);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return 128 + WTERMSIG(status);
}

// Submits all requests, keeping the queue full, and returns every completion.
std::vector<UringFile::Completion> run_all(UringFile& f,
                                           const std::vector<UringFile::Request>& requests) {
  std::vector<UringFile::Completion> done;
  size_t next = 0;
  while (done.size() < requests.size()) {
    while (next < requests.size() && f.in_flight() < f.queue_depth()) f.submit(requests[next++]);
    const size_t before = done.size();
    const size_t n = f.reap(&done, -1);
    EXPECT_EQ(n, done.size() - before);
    if (n == 0) {
      ADD_FAILURE() << "reap(-1) returned nothing with " << f.in_flight() << " in flight";
      break;
    }
  }
  return done;
}

void expect_all_ok(const std::vector<UringFile::Completion>& done,
                   const std::vector<UringFile::Request>& requests) {
  ASSERT_EQ(done.size(), requests.size());
  std::set<uint64_t> tags;
  for (const auto& c : done) {
    ASSERT_LT(c.tag, requests.size());
    EXPECT_EQ(c.error, 0) << "tag " << c.tag << ": " << std::strerror(c.error);
    EXPECT_EQ(c.offset, requests[c.tag].offset) << "tag " << c.tag;
    tags.insert(c.tag);
  }
  EXPECT_EQ(tags.size(), requests.size()) << "a request completed twice";
}

constexpr size_t kStripeUnit = 1 << 20;
constexpr unsigned kRamStripes = 8;

std::string stripe_path(const std::string& path, unsigned k) {
  return k == 0 ? path : path + "." + std::to_string(k);
}

// Whether exactly the physical files of a file striped over `stripes` exist.
void expect_physical_files(const std::string& path, unsigned stripes) {
  for (unsigned k = 0; k <= kRamStripes; ++k) {
    EXPECT_EQ(std::filesystem::exists(stripe_path(path, k)), k < stripes) << stripe_path(path, k);
  }
}

// Logical [0, total) of a file striped over `stripes` physical files, read with plain
// pread following the documented layout: 1 MiB unit u lies in file u % stripes at
// (u / stripes) MiB.
std::vector<char> read_striped(const std::string& path, unsigned stripes, size_t total) {
  std::vector<int> fds;
  for (unsigned k = 0; k < stripes; ++k) {
    fds.push_back(::open(stripe_path(path, k).c_str(), O_RDONLY));
  }
  std::vector<char> out(total);
  for (size_t at = 0; at < total;) {
    const size_t unit = at / kStripeUnit;
    const size_t len = std::min(total - at, kStripeUnit - at % kStripeUnit);
    const auto local = static_cast<off_t>(unit / stripes * kStripeUnit + at % kStripeUnit);
    EXPECT_EQ(::pread(fds[unit % stripes], out.data() + at, len, local), static_cast<ssize_t>(len))
        << "logical offset " << at;
    at += len;
  }
  for (int fd : fds) ::close(fd);
  return out;
}

// Writes random data with many requests in flight (in shuffled order), reads it back the
// same way, and checks it against both the source and a plain pread of the file(s).
void round_trip(const std::string& dir, bool registered, bool direct_io, bool expect_direct,
                unsigned expect_stripes = 1, bool stripe_ram = true) {
  UringFile f(dir + "/data", UringFile::Options{16, direct_io, false, stripe_ram});
  EXPECT_EQ(f.direct(), expect_direct);

  // 300 chunks of 1 to 4 pages, laid out back to back.
  std::mt19937_64 rng(registered ? 1 : 2);
  std::vector<std::pair<uint64_t, size_t>> chunks;
  uint64_t total = 0;
  for (int i = 0; i < 300; ++i) {
    const size_t len = (1 + rng() % 4) * kPage;
    chunks.emplace_back(total, len);
    total += len;
  }
  AlignedBuf src = aligned_buf(total);
  AlignedBuf dst = aligned_buf(total);
  fill_random(src.get(), total, 42);
  std::memset(dst.get(), 0, total);
  if (registered) f.register_buffers({{src.get(), total}, {dst.get(), total}});

  std::shuffle(chunks.begin(), chunks.end(), rng);
  std::vector<UringFile::Request> writes, reads;
  for (const auto& [off, len] : chunks) {
    writes.push_back({writes.size(), true, src.get() + off, len, off, registered ? 0 : -1});
  }
  std::shuffle(chunks.begin(), chunks.end(), rng);
  for (const auto& [off, len] : chunks) {
    reads.push_back({reads.size(), false, dst.get() + off, len, off, registered ? 1 : -1});
  }

  expect_all_ok(run_all(f, writes), writes);
  f.sync();
  EXPECT_EQ(f.size(), total);
  expect_all_ok(run_all(f, reads), reads);
  EXPECT_EQ(f.in_flight(), 0u);
  EXPECT_EQ(std::memcmp(src.get(), dst.get(), total), 0) << "data read back differs";

  // Independent check that each chunk landed at its own offset.
  expect_physical_files(dir + "/data", expect_stripes);
  const std::vector<char> plain = read_striped(dir + "/data", expect_stripes, total);
  EXPECT_EQ(std::memcmp(src.get(), plain.data(), total), 0) << "file contents differ";
}

TEST(UringFile, RoundTripUnregisteredBuffers) {
  TempDir dir;
  round_trip(dir.path(), false, true, filesystem_accepts_direct(dir.path()));
}

TEST(UringFile, RoundTripRegisteredBuffers) {
  TempDir dir;
  round_trip(dir.path(), true, true, filesystem_accepts_direct(dir.path()));
}

// tmpfs refuses O_DIRECT before Linux 6.6 and accepts it since: either way the mode must
// match what the filesystem does.
// tmpfs takes O_DIRECT since Linux 6.6, but files in RAM have no cache to bypass and
// their buffered path is the fast one: always buffered there.
TEST(UringFile, BufferedOnTmpfs) {
  TempDir dir("/dev/shm");
  round_trip(dir.path(), false, true, false, kRamStripes);
  UringFile::remove_files(dir.file("data"));
  expect_physical_files(dir.file("data"), 0);
  round_trip(dir.path(), true, true, false, kRamStripes);
}

// A store mapped for the device's copies keeps its file in RAM whole (stripe_ram off):
// one physical file, the logical bytes at their own offsets.
TEST(UringFile, UnstripedOnTmpfsIsOneFile) {
  TempDir dir("/dev/shm");
  round_trip(dir.path(), false, true, false, 1, false);
  UringFile::remove_files(dir.file("data"));
  round_trip(dir.path(), true, true, false, 1, false);
}

TEST(UringFile, BufferedWhenDirectNotTried) {
  TempDir dir;
  round_trip(dir.path(), false, false, false);
  std::filesystem::remove(dir.file("data"));
  round_trip(dir.path(), true, false, false);
}

// ramfs refuses O_DIRECT at open(). Mounting one needs a private mount namespace, which
// needs CAP_SYS_ADMIN; the test is skipped without it.
TEST(UringFile, FallsBackToBufferedWhereDirectIsRefused) {
  TempDir dir;
  const int code = run_in_child([&] {
    if (::unshare(CLONE_NEWNS) != 0) return 77;
    if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return 77;
    if (::mount("none", dir.path().c_str(), "ramfs", 0, nullptr) != 0) return 77;
    if (filesystem_accepts_direct(dir.path())) return 77;  // a ramfs that takes O_DIRECT
    round_trip(dir.path(), false, true, false, kRamStripes);
    round_trip(dir.path(), true, true, false, kRamStripes);
    return ::testing::Test::HasFailure() ? 1 : 0;
  });
  if (code == 77) GTEST_SKIP() << "cannot mount a ramfs here";
  EXPECT_EQ(code, 0);
}

// Requests of 1 to 768 pages, back to back so that most cross stripe units, many in
// flight; read back in differently cut requests, and in one request far larger than the
// ring, which must wait for room piece by piece.
class UringFileStriped : public ::testing::TestWithParam<bool> {};

TEST_P(UringFileStriped, RoundTripAcrossStripeUnits) {
  const bool registered = GetParam();
  TempDir dir("/dev/shm");
  const std::string path = dir.file("data");
  UringFile f(path, UringFile::Options{16, true});
  EXPECT_FALSE(f.direct());
  EXPECT_EQ(f.path(), path);
  expect_physical_files(path, kRamStripes);

  std::mt19937_64 rng(registered ? 3 : 4);
  auto cut = [&](uint64_t total) {
    std::vector<std::pair<uint64_t, size_t>> chunks;
    for (uint64_t at = 0; at < total;) {
      const size_t len = std::min<uint64_t>((1 + rng() % 768) * kPage, total - at);
      chunks.emplace_back(at, len);
      at += len;
    }
    std::shuffle(chunks.begin(), chunks.end(), rng);
    return chunks;
  };
  const uint64_t total = 40 * kStripeUnit + 13 * kPage;
  AlignedBuf src = aligned_buf(total);
  AlignedBuf dst = aligned_buf(total);
  fill_random(src.get(), total, 5);
  std::memset(dst.get(), 0, total);
  if (registered) f.register_buffers({{src.get(), total}, {dst.get(), total}});
  const int src_index = registered ? 0 : -1, dst_index = registered ? 1 : -1;

  std::vector<UringFile::Request> writes, reads;
  for (const auto& [off, len] : cut(total)) {
    writes.push_back({writes.size(), true, src.get() + off, len, off, src_index});
  }
  for (const auto& [off, len] : cut(total)) {
    reads.push_back({reads.size(), false, dst.get() + off, len, off, dst_index});
  }
  expect_all_ok(run_all(f, writes), writes);
  f.sync();
  EXPECT_EQ(f.size(), total);
  expect_all_ok(run_all(f, reads), reads);
  EXPECT_EQ(std::memcmp(src.get(), dst.get(), total), 0) << "data read back differs";
  EXPECT_EQ(std::memcmp(src.get(), read_striped(path, kRamStripes, total).data(), total), 0)
      << "physical layout differs";

  {
    UringFile one(path, UringFile::Options{1, true});  // a ring of 8 entries
    std::memset(dst.get(), 0, total);
    const std::vector<UringFile::Request> whole = {{0, false, dst.get(), total, 0, -1}};
    expect_all_ok(run_all(one, whole), whole);
    EXPECT_EQ(std::memcmp(src.get(), dst.get(), total), 0) << "one large read differs";
  }

  // Past the logical end: in the last unit's file, in files with no data there, straddling.
  auto done = run_all(f, {{0, false, dst.get(), kPage, total, dst_index},
                          {1, false, dst.get(), kPage, total + 3 * kStripeUnit, dst_index},
                          {2, false, dst.get(), 3 * kStripeUnit, total - 2 * kStripeUnit - kPage,
                           dst_index}});
  ASSERT_EQ(done.size(), 3u);
  std::sort(done.begin(), done.end(), [](auto& a, auto& b) { return a.tag < b.tag; });
  const uint64_t at[] = {total, total + 3 * kStripeUnit, total};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(done[i].error, ENODATA) << "tag " << i;
    EXPECT_EQ(done[i].offset, at[i]) << "tag " << i;
  }
  EXPECT_EQ(f.in_flight(), 0u);
}

INSTANTIATE_TEST_SUITE_P(RegisteredAndNot, UringFileStriped, ::testing::Bool());

// spans() names the physical bytes of any logical range: reading them there gives what
// the ring wrote at those logical offsets. One span per range when not striped.
class UringFileSpans : public ::testing::TestWithParam<const char*> {};

TEST_P(UringFileSpans, LocateWhatTheRingWrote) {
  TempDir dir(GetParam());
  const std::string path = dir.file("data");
  UringFile f(path, UringFile::Options{8, true});
  const std::vector<std::string> files = f.physical_paths();
  ASSERT_EQ(files.size(), std::string(GetParam()) == "/dev/shm" ? kRamStripes : 1u);
  EXPECT_EQ(files[0], path);
  const uint64_t total = 21 * kStripeUnit + 5 * kPage;
  AlignedBuf src = aligned_buf(total);
  fill_random(src.get(), total, 11);
  const std::vector<UringFile::Request> writes = {{0, true, src.get(), total, 0, -1}};
  expect_all_ok(run_all(f, writes), writes);
  std::vector<int> fds;
  for (const std::string& name : files) fds.push_back(::open(name.c_str(), O_RDONLY));
  std::mt19937_64 rng(12);
  for (int round = 0; round < 50; ++round) {
    const uint64_t offset = rng() % (total / kPage) * kPage;
    const uint64_t length = 1 + rng() % (total - offset);
    std::vector<char> got;
    uint64_t covered = 0;
    for (const UringFile::Span& s : f.spans(offset, length)) {
      ASSERT_LT(s.file, fds.size());
      if (files.size() > 1) ASSERT_LE(s.offset % kStripeUnit + s.length, kStripeUnit);
      std::vector<char> piece(s.length);
      ASSERT_EQ(::pread(fds[s.file], piece.data(), s.length, static_cast<off_t>(s.offset)),
                static_cast<ssize_t>(s.length));
      got.insert(got.end(), piece.begin(), piece.end());
      covered += s.length;
    }
    ASSERT_EQ(covered, length);
    if (files.size() == 1) EXPECT_EQ(f.spans(offset, length).size(), 1u);
    EXPECT_EQ(std::memcmp(got.data(), src.get() + offset, length), 0)
        << "range " << offset << "+" << length;
  }
  for (int fd : fds) ::close(fd);
  EXPECT_TRUE(f.spans(kPage, 0).empty());
}

INSTANTIATE_TEST_SUITE_P(DiskAndRam, UringFileSpans, ::testing::Values("/tmp", "/dev/shm"));

// allocate() sizes each physical file for its share of [0, end); size() inverts that.
TEST(UringFile, StripedAllocateAndSize) {
  TempDir dir("/dev/shm");
  const std::string path = dir.file("data");
  UringFile f(path, UringFile::Options{});
  EXPECT_EQ(f.size(), 0u);
  auto sizes = [&] {
    std::vector<uint64_t> out;
    for (unsigned k = 0; k < kRamStripes; ++k) {
      out.push_back(std::filesystem::file_size(stripe_path(path, k)));
    }
    return out;
  };
  const uint64_t M = kStripeUnit;
  f.allocate(5 * M + 3 * kPage);
  EXPECT_EQ(f.size(), 5 * M + 3 * kPage);
  EXPECT_EQ(sizes(), (std::vector<uint64_t>{M, M, M, M, M, 3 * kPage, 0, 0}));
  f.allocate(20 * M + kPage);
  EXPECT_EQ(f.size(), 20 * M + kPage);
  EXPECT_EQ(sizes(), (std::vector<uint64_t>{3 * M, 3 * M, 3 * M, 3 * M, 2 * M + kPage, 2 * M, 2 * M,
                                            2 * M}));
  f.allocate(M);  // smaller: nothing changes
  EXPECT_EQ(f.size(), 20 * M + kPage);
}

class UringFileEof : public ::testing::TestWithParam<bool> {};

TEST_P(UringFileEof, ReadPastEndGivesEnodata) {
  TempDir dir;
  UringFile f(dir.file("data"), UringFile::Options{4, GetParam()});
  AlignedBuf buf = aligned_buf(4 * kPage);
  fill_random(buf.get(), 2 * kPage, 7);
  const std::vector<UringFile::Request> write = {{0, true, buf.get(), 2 * kPage, 0, -1}};
  expect_all_ok(run_all(f, write), write);

  AlignedBuf in = aligned_buf(4 * kPage);
  std::memset(in.get(), 0, 4 * kPage);
  auto done = run_all(f, {{5, false, in.get(), 4 * kPage, 0, -1},
                     {6, false, in.get() + 3 * kPage, kPage, 4 * kPage, -1}});
  ASSERT_EQ(done.size(), 2u);
  std::sort(done.begin(), done.end(), [](auto& a, auto& b) { return a.tag < b.tag; });
  EXPECT_EQ(done[0].tag, 5u);
  EXPECT_EQ(done[0].error, ENODATA);
  EXPECT_EQ(done[0].offset, 2 * kPage);
  EXPECT_EQ(std::memcmp(in.get(), buf.get(), 2 * kPage), 0) << "the part before EOF was read";
  EXPECT_EQ(done[1].tag, 6u);
  EXPECT_EQ(done[1].error, ENODATA);
  EXPECT_EQ(done[1].offset, 4 * kPage);

  // A file whose size is not a multiple of the alignment stops exactly at its end.
  ASSERT_EQ(::truncate(dir.file("data").c_str(), 5000), 0);
  done = run_all(f, {{0, false, in.get(), 2 * kPage, 0, -1}});
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].error, ENODATA);
  EXPECT_EQ(done[0].offset, 5000u);
}

INSTANTIATE_TEST_SUITE_P(DirectAndBuffered, UringFileEof, ::testing::Bool());

TEST(UringFile, SubmitBeyondQueueDepthThrowsUsageError) {
  TempDir dir;
  UringFile f(dir.file("data"), UringFile::Options{2, true});
  EXPECT_EQ(f.queue_depth(), 2u);
  AlignedBuf buf = aligned_buf(3 * kPage);
  std::memset(buf.get(), 1, 3 * kPage);
  f.submit({0, true, buf.get(), kPage, 0, -1});
  f.submit({1, true, buf.get() + kPage, kPage, kPage, -1});
  EXPECT_EQ(f.in_flight(), 2u);
  EXPECT_THROW(f.submit({2, true, buf.get() + 2 * kPage, kPage, 2 * kPage, -1}), UsageError);
  EXPECT_EQ(f.in_flight(), 2u);

  std::vector<UringFile::Completion> done;
  while (done.size() < 2) ASSERT_GT(f.reap(&done, -1), 0u);
  EXPECT_EQ(f.in_flight(), 0u);
  f.submit({2, true, buf.get() + 2 * kPage, kPage, 2 * kPage, -1});  // room again
  while (done.size() < 3) ASSERT_GT(f.reap(&done, -1), 0u);
  for (const auto& c : done) EXPECT_EQ(c.error, 0);
  EXPECT_EQ(f.size(), 3 * kPage);
}

TEST(UringFile, RejectsMisalignedAndUnregisteredRequests) {
  TempDir dir;
  UringFile f(dir.file("data"), UringFile::Options{4, true});
  AlignedBuf buf = aligned_buf(2 * kPage);
  EXPECT_THROW(f.submit({0, true, buf.get() + 1, kPage, 0, -1}), UsageError);
  EXPECT_THROW(f.submit({0, true, buf.get(), 100, 0, -1}), UsageError);
  EXPECT_THROW(f.submit({0, true, buf.get(), kPage, 100, -1}), UsageError);
  EXPECT_THROW(f.submit({0, true, buf.get(), 0, 0, -1}), UsageError);
  EXPECT_THROW(f.submit({0, true, buf.get(), kPage, 0, 0}), UsageError);  // nothing registered
  f.register_buffers({{buf.get(), kPage}});
  EXPECT_THROW(f.submit({0, true, buf.get(), 2 * kPage, 0, 0}), UsageError);  // overruns it
  EXPECT_EQ(f.in_flight(), 0u);
}

TEST(UringFile, ReapWithNothingInFlightReturnsZero) {
  TempDir dir;
  UringFile f(dir.file("data"), UringFile::Options{});
  std::vector<UringFile::Completion> done;
  EXPECT_EQ(f.reap(&done, 0), 0u);
  EXPECT_EQ(f.reap(&done, 1000), 0u);
  EXPECT_EQ(f.reap(&done, -1), 0u);  // must not wait forever
  EXPECT_TRUE(done.empty());
}

TEST(UringFile, OpenKeepsExistingContents) {
  TempDir dir;
  std::vector<char> data(5000);
  fill_random(data.data(), data.size(), 3);
  {
    int fd = ::open(dir.file("data").c_str(), O_WRONLY | O_CREAT, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, data.data(), data.size()), 5000);
    ::close(fd);
  }
  UringFile f(dir.file("data"), UringFile::Options{});
  EXPECT_EQ(f.size(), 5000u) << "the O_DIRECT probe must not change the size";
  AlignedBuf in = aligned_buf(kPage);
  auto done = run_all(f, {{0, false, in.get(), kPage, 0, -1}});
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].error, 0);
  EXPECT_EQ(std::memcmp(in.get(), data.data(), kPage), 0);
}

// Files added to one ring: offsets name the file; each file keeps its own bytes, spans
// index the concatenated physical paths, and a request may not cross into another file.
class UringFileFiles : public ::testing::TestWithParam<const char*> {};

TEST_P(UringFileFiles, OffsetsNameTheFile) {
  TempDir dir(GetParam());
  UringFile f(dir.file("a"), UringFile::Options{8, true});
  ::mkdir(dir.file("sub").c_str(), 0755);
  const unsigned b = f.add_file(dir.file("sub/b"));
  ASSERT_EQ(b, 1u);
  EXPECT_EQ(f.file_count(), 2u);
  EXPECT_EQ(f.file_path(1), dir.file("sub/b"));
  const uint64_t base = UringFile::kRegionBytes;
  const size_t n = 3 * kStripeUnit + 2 * kPage;  // spans stripes in RAM
  AlignedBuf x = aligned_buf(n), y = aligned_buf(n), got = aligned_buf(n);
  fill_random(x.get(), n, 1);
  fill_random(y.get(), n, 2);
  f.allocate(kPage + n);
  f.allocate(base + n);
  expect_all_ok(run_all(f, {{0, true, x.get(), n, kPage, -1}, {1, true, y.get(), n, base, -1}}),
                {{0, true, x.get(), n, kPage, -1}, {1, true, y.get(), n, base, -1}});
  EXPECT_EQ(f.size(0), kPage + n);
  EXPECT_EQ(f.size(1), n);
  ASSERT_EQ(run_all(f, {{0, false, got.get(), n, base, -1}})[0].error, 0);
  EXPECT_EQ(std::memcmp(got.get(), y.get(), n), 0);
  ASSERT_EQ(run_all(f, {{0, false, got.get(), n, kPage, -1}})[0].error, 0);
  EXPECT_EQ(std::memcmp(got.get(), x.get(), n), 0);

  // File 1's bytes read back through spans() and physical_paths(), as checkpoints do.
  const std::vector<std::string> paths = f.physical_paths();
  const size_t a_files = std::string(GetParam()) == "/dev/shm" ? kRamStripes : 1;
  ASSERT_EQ(paths.size(), 2 * a_files);
  std::vector<char> copy;
  for (const UringFile::Span& s : f.spans(base, n)) {
    ASSERT_GE(s.file, a_files) << "a span of file 1 points into file 0";
    std::vector<char> piece(s.length);
    const int fd = ::open(paths[s.file].c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pread(fd, piece.data(), s.length, static_cast<off_t>(s.offset)),
              static_cast<ssize_t>(s.length));
    ::close(fd);
    copy.insert(copy.end(), piece.begin(), piece.end());
  }
  ASSERT_EQ(copy.size(), n);
  EXPECT_EQ(std::memcmp(copy.data(), y.get(), n), 0);

  EXPECT_THROW(f.submit({0, false, got.get(), 2 * kPage, base - kPage, -1}), UsageError);
  EXPECT_THROW(f.submit({0, false, got.get(), kPage, 2 * base, -1}), UsageError);
}

INSTANTIATE_TEST_SUITE_P(DiskAndRam, UringFileFiles, ::testing::Values("/tmp", "/dev/shm"));

// In RAM allocate() sizes the files without allocating (zeroing) their pages: the writes
// do that, on many workers.
// In RAM allocate() sets the size with the last page alone (fallocate, which never shrinks
// a file, unlike a check-then-ftruncate racing a restore's writes), and never shrinks.
TEST(UringFile, RamAllocateTakesTheLastPageOnly) {
  TempDir dir("/dev/shm");
  UringFile f(dir.file("data"), UringFile::Options{});
  f.allocate(64 * kStripeUnit);
  EXPECT_EQ(f.size(), 64 * kStripeUnit);
  for (unsigned k = 0; k < kRamStripes; ++k) {
    struct stat st;
    ASSERT_EQ(::stat(stripe_path(dir.file("data"), k).c_str(), &st), 0);
    EXPECT_EQ(uint64_t(st.st_size), 8 * kStripeUnit);
    EXPECT_LE(uint64_t(st.st_blocks) * 512, kPage) << "stripe " << k << " was preallocated";
  }
  // A stripe written past the size (a restore's copy) keeps its length when allocate()
  // extends the others.
  const std::string stripe0 = stripe_path(dir.file("data"), 0);
  ASSERT_EQ(::truncate(stripe0.c_str(), 20 * kStripeUnit), 0);
  f.allocate(72 * kStripeUnit);
  struct stat st;
  ASSERT_EQ(::stat(stripe0.c_str(), &st), 0);
  EXPECT_EQ(uint64_t(st.st_size), 20 * kStripeUnit);
}

TEST(UringFile, AllocateReservesSpace) {
  TempDir dir;
  UringFile f(dir.file("data"), UringFile::Options{});
  f.allocate(1 << 20);
  EXPECT_EQ(f.size(), 1u << 20);
  struct stat st;
  ASSERT_EQ(::stat(dir.file("data").c_str(), &st), 0);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 1u << 20);
  f.allocate(kPage);  // smaller: nothing changes
  EXPECT_EQ(f.size(), 1u << 20);
  f.allocate(2 << 20);
  EXPECT_EQ(f.size(), 2u << 20);
}

TEST(UringFile, OpenFailureNamesThePath) {
  const std::string path = "/nonexistent_statepager_dir/data";
  try {
    UringFile f(path, UringFile::Options{});
    FAIL() << "opening " << path << " succeeded";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOENT);
    EXPECT_EQ(e.path(), path);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

// The open-file flags (fdinfo) of every descriptor of this process open on `path`.
std::vector<long> open_flags_of(const std::string& path) {
  std::vector<long> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(e.path(), ec) != path) continue;
    std::ifstream info("/proc/self/fdinfo/" + e.path().filename().string());
    for (std::string key; info >> key;) {
      if (key == "flags:") {
        std::string octal;
        info >> octal;
        out.push_back(std::stol(octal, nullptr, 8));
      }
    }
  }
  return out;
}

// O_DIRECT is switched on after the open (fcntl): the descriptor must carry it exactly
// when direct() says so.
TEST(UringFile, DirectModeIsOnTheDescriptor) {
  TempDir dir;
  for (bool direct_io : {true, false}) {
    const std::string path = dir.file(direct_io ? "direct" : "buffered");
    UringFile f(path, UringFile::Options{4, direct_io, true});
    EXPECT_EQ(f.direct(), direct_io && filesystem_accepts_direct(dir.path()));
    const std::vector<long> flags = open_flags_of(path);
    ASSERT_EQ(flags.size(), 1u) << path;
    EXPECT_EQ((flags[0] & O_DIRECT) != 0, f.direct()) << path;
  }
}

void expect_refused_with(int err, const std::string& path, bool create_new) {
  try {
    UringFile f(path, UringFile::Options{4, true, create_new});
    ADD_FAILURE() << path << " was opened";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), err) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A file, or a symbolic link (also as a RAM store's stripe), in the place of a file to
// be created new is refused and left as it was; a link is never followed, new or not.
TEST(UringFile, CreateNewNeverTakesAnExistingFileNorFollowsALink) {
  for (const char* base : {"/tmp", "/dev/shm"}) {
    SCOPED_TRACE(base);
    TempDir dir(base);
    std::ofstream(dir.file("victim")) << "precious";
    std::ofstream(dir.file("taken")) << "mine";
    expect_refused_with(EEXIST, dir.file("taken"), true);
    std::filesystem::create_symlink(dir.file("victim"), dir.file("link"));
    expect_refused_with(EEXIST, dir.file("link"), true);
    expect_refused_with(ELOOP, dir.file("link"), false);
    EXPECT_EQ(slurp(dir.file("taken")), "mine");
    EXPECT_EQ(slurp(dir.file("victim")), "precious");
  }
  TempDir ram("/dev/shm");
  std::ofstream(ram.file("victim")) << "precious";
  std::filesystem::create_symlink(ram.file("victim"), ram.file("data.3"));
  expect_refused_with(EEXIST, ram.file("data"), true);
  expect_refused_with(ELOOP, ram.file("data.3"), false);
  EXPECT_EQ(slurp(ram.file("victim")), "precious");
}

// RLIMIT_FSIZE stands in for a full filesystem: fallocate and writes past it fail with
// EFBIG. Runs in a child so the limit does not leak into the test process.
TEST(UringFile, FileSizeLimitGivesNoSpaceErrorAndEfbig) {
  TempDir dir;
  constexpr uint64_t kLimit = 1 << 20;
  for (bool direct_io : {true, false}) {
    SCOPED_TRACE(direct_io ? "direct" : "buffered");
    const std::string path = dir.file(direct_io ? "direct" : "buffered");
    const int code = run_in_child([&] {
      std::signal(SIGXFSZ, SIG_IGN);
      rlimit lim{};
      if (::getrlimit(RLIMIT_FSIZE, &lim) != 0) return 10;
      lim.rlim_cur = kLimit;
      if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return 10;

      UringFile f(path, UringFile::Options{4, direct_io});
      f.allocate(kLimit / 2);
      try {
        f.allocate(2 * kLimit);
        return 11;  // no error
      } catch (const NoSpaceError& e) {
        if (e.error_number() != EFBIG) return 12;
        if (e.path() != path) return 13;
      }

      AlignedBuf buf = aligned_buf(2 * kPage);
      std::memset(buf.get(), 5, 2 * kPage);
      // Entirely past the limit.
      auto done = run_all(f, {{0, true, buf.get(), kPage, kLimit, -1}});
      if (done.size() != 1 || done[0].error != EFBIG) return 14;
      if (done[0].offset != kLimit) return 15;
      // Straddling it: the first page is written, the failure is reported at the limit.
      done = run_all(f, {{1, true, buf.get(), 2 * kPage, kLimit - kPage, -1}});
      if (done.size() != 1 || done[0].error != EFBIG) return 16;
      if (done[0].offset != kLimit) return 17;
      if (f.size() != kLimit) return 18;
      return 0;
    });
    EXPECT_EQ(code, 0) << "10: setrlimit failed, 11: allocate did not throw, 12: not EFBIG, "
                          "13: wrong path, 14/16: write did not fail with EFBIG, 15/17: wrong "
                          "offset, 18: wrong size, 99: unexpected exception";
  }
}

}  // namespace
}  // namespace statepager
