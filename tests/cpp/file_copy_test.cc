// copy_range / copy_file: every method copies exactly the range asked for; refused
// methods fall through; a short source is reported as corrupt; the checksummed copy is
// exact around its buffer's boundaries and names the file of an I/O error.
//
// Reflink is exercised where the filesystem allows it: on $STATEPAGER_REFLINK_DIR (e.g. a
// mounted XFS made with reflink=1, or btrfs), else on /tmp if it happens to support it.
#include "backing/file_copy.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "backing/crc32c.h"
#include "backing/errors.h"
#include "tests/cpp/temp_dir.h"

namespace statepager {
namespace {


std::vector<char> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<char> out(n);
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

void write_file(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

// Ranges of a 6 MiB source copied to shuffled places of the destination; what lands
// there is exactly the source range, and bytes not copied over are untouched.
void copy_ranges(const std::string& src_dir, const std::string& dst_dir, CopyMethod first,
                 bool aligned, std::vector<CopyMethod>* used) {
  const size_t total = 6 << 20, page = 4096;
  const std::vector<char> src_bytes = random_bytes(total, 1);
  const std::string src_path = src_dir + "/src", dst_path = dst_dir + "/dst";
  write_file(src_path, src_bytes);
  std::vector<char> expect = random_bytes(total, 2);
  write_file(dst_path, expect);
  const OpenFile src(src_path, OpenFile::kRead), dst(dst_path, OpenFile::kWrite);
  std::mt19937_64 rng(3);
  CopyMethod method = first;
  for (int i = 0; i < 20; i++) {
    uint64_t from = rng() % total, to = rng() % total;
    uint64_t length = 1 + rng() % std::min(total - from, total - to);
    if (aligned) {  // what reflink can share
      from = from / page * page;
      to = to / page * page;
      length = page * (1 + rng() % (std::min(total - from, total - to) / page));
    }
    method = copy_range(src, from, dst, to, length, method);
    used->push_back(method);
    std::copy(src_bytes.begin() + from, src_bytes.begin() + from + length, expect.begin() + to);
  }
  dst.sync();
  EXPECT_EQ(read_file(dst_path), expect);
}

TEST(FileCopy, EveryMethodCopiesExactlyTheRange) {
  TempDir dir("/tmp");
  for (CopyMethod first : {CopyMethod::kReflink, CopyMethod::kCopyFileRange,
                           CopyMethod::kReadWrite}) {
    for (bool aligned : {false, true}) {
      std::vector<CopyMethod> used;
      copy_ranges(dir.path(), dir.path(), first, aligned, &used);
      // Never a method before the one asked for; read_write only when asked for (ext4
      // and the like copy within a filesystem with copy_file_range).
      for (CopyMethod m : used) {
        EXPECT_GE(static_cast<int>(m), static_cast<int>(first));
        if (first != CopyMethod::kReadWrite) EXPECT_NE(m, CopyMethod::kReadWrite);
      }
    }
  }
}

TEST(FileCopy, AcrossFilesystemsFallsBack) {
  TempDir disk("/tmp"), ram("/dev/shm");
  std::vector<CopyMethod> used;
  copy_ranges(disk.path(), ram.path(), CopyMethod::kReflink, true, &used);
  for (CopyMethod m : used) EXPECT_NE(m, CopyMethod::kReflink);
}

TEST(FileCopy, ShortSourceIsCorrupt) {
  TempDir dir("/tmp");
  write_file(dir.file("src"), random_bytes(10000, 4));
  const OpenFile src(dir.file("src"), OpenFile::kRead), dst(dir.file("dst"), OpenFile::kWrite);
  for (CopyMethod first : {CopyMethod::kReflink, CopyMethod::kCopyFileRange,
                           CopyMethod::kReadWrite}) {
    try {
      copy_range(src, 4096, dst, 0, 8192, first);
      ADD_FAILURE() << "no error for " << copy_method_name(first);
    } catch (const CorruptStoreError& e) {
      EXPECT_NE(std::string(e.what()).find(dir.file("src")), std::string::npos) << e.what();
    }
  }
}

// The checksummed copy (read_write through kReadWriteBufferBytes) at lengths around the
// buffer's multiples, from an unaligned offset, with chunks that straddle its pieces: the
// destination holds exactly the source range and the crcs are the source's.
TEST(FileCopy, ChecksummedCopyAroundBufferBoundaries) {
  TempDir dir("/tmp");
  const size_t b = kReadWriteBufferBytes, from = 4097, chunk = b / 3 + 1;
  const std::vector<char> bytes = random_bytes(3 * b + 2 * 4096 + from, 8);
  write_file(dir.file("src"), bytes);
  for (size_t length : {size_t(1), b - 1, b, b + 1, 2 * b - 1, 2 * b, 2 * b + 1, 3 * b + 4097}) {
    std::vector<uint32_t> want;
    for (size_t at = 0; at < length; at += chunk) {
      want.push_back(crc32c(0, bytes.data() + from + at, std::min(chunk, length - at)));
    }
    {
      const OpenFile src(dir.file("src"), OpenFile::kRead);
      const OpenFile dst(dir.file("dst"), OpenFile::kWrite);
      ChunkCrcs crcs(chunk);
      EXPECT_EQ(copy_range(src, from, dst, 123, length, CopyMethod::kReadWrite, &crcs),
                CopyMethod::kReadWrite);
      EXPECT_EQ(crcs.take(), want) << length;
    }
    const std::vector<char> got = read_file(dir.file("dst"));
    ASSERT_GE(got.size(), 123 + length);
    EXPECT_TRUE(std::equal(got.begin() + 123, got.begin() + 123 + length, bytes.begin() + from))
        << length;
    std::filesystem::remove(dir.file("dst"));
  }
}

// A source cut short inside the second buffer's worth is corrupt, named; the bytes before
// the cut were copied, none after it.
TEST(FileCopy, ChecksummedCopyOfAShortSourceIsCorrupt) {
  TempDir dir("/tmp");
  const size_t b = kReadWriteBufferBytes;
  write_file(dir.file("src"), random_bytes(b + 100, 9));
  const OpenFile src(dir.file("src"), OpenFile::kRead), dst(dir.file("dst"), OpenFile::kWrite);
  ChunkCrcs crcs(1 << 20);
  try {
    copy_range(src, 0, dst, 0, 2 * b, CopyMethod::kReadWrite, &crcs);
    ADD_FAILURE() << "no error for a source that ends inside the range";
  } catch (const CorruptStoreError& e) {
    EXPECT_NE(std::string(e.what()).find(dir.file("src")), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(b + 100)), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(read_file(dir.file("dst")).size(), b + 100);
}

// Real errors of the copy's read and write name the file: a directory cannot be read
// (EISDIR), /dev/full cannot be written (ENOSPC: NoSpaceError).
TEST(FileCopy, ChecksummedCopyErrorsNameTheFile) {
  TempDir dir("/tmp");
  write_file(dir.file("src"), random_bytes(3 * kReadWriteBufferBytes, 10));
  ChunkCrcs crcs(1 << 20);
  {
    const OpenFile src(dir.path(), OpenFile::kRead), dst(dir.file("dst"), OpenFile::kWrite);
    try {
      copy_range(src, 0, dst, 0, 4096, CopyMethod::kReadWrite, &crcs);
      ADD_FAILURE() << "read a directory";
    } catch (const IoError& e) {
      EXPECT_EQ(e.path(), dir.path());
      EXPECT_EQ(e.error_number(), EISDIR);
    }
  }
  if (::access("/dev/full", W_OK) != 0) GTEST_SKIP() << "no writable /dev/full here";
  const OpenFile src(dir.file("src"), OpenFile::kRead), dst("/dev/full", OpenFile::kWrite);
  try {
    copy_range(src, 0, dst, 0, 3 * kReadWriteBufferBytes, CopyMethod::kReadWrite, &crcs);
    ADD_FAILURE() << "wrote to /dev/full";
  } catch (const NoSpaceError& e) {
    EXPECT_EQ(e.path(), "/dev/full");
    EXPECT_EQ(e.offset(), 0u);
  }
}

TEST(FileCopy, MissingFileNamesIt) {
  TempDir dir("/tmp");
  try {
    OpenFile f(dir.file("nope"), OpenFile::kRead);
    ADD_FAILURE() << "opened a missing file";
  } catch (const IoError& e) {
    EXPECT_EQ(e.path(), dir.file("nope"));
  }
}

TEST(FileCopy, WholeFile) {
  TempDir dir("/tmp");
  const std::vector<char> bytes = random_bytes((3 << 20) + 123, 5);
  write_file(dir.file("src"), bytes);
  write_file(dir.file("dst"), random_bytes(5 << 20, 6));  // longer: truncated first
  copy_file(dir.file("src"), dir.file("dst"));
  EXPECT_EQ(read_file(dir.file("dst")), bytes);
}

TEST(FileCopy, ReflinkSharesBlocksWhereSupported) {
  const char* env = std::getenv("STATEPAGER_REFLINK_DIR");
  TempDir dir(env != nullptr ? env : "/tmp");
  const std::vector<char> bytes = random_bytes(4 << 20, 7);
  write_file(dir.file("src"), bytes);
  const OpenFile src(dir.file("src"), OpenFile::kRead), dst(dir.file("dst"), OpenFile::kWrite);
  const CopyMethod m = copy_range(src, 1 << 20, dst, 8192, 2 << 20);
  if (m != CopyMethod::kReflink) {
    EXPECT_EQ(env, nullptr) << "STATEPAGER_REFLINK_DIR=" << env << " does not reflink";
    GTEST_SKIP() << "no reflink on " << (env ? env : "/tmp")
                 << ": set STATEPAGER_REFLINK_DIR to a btrfs or XFS (reflink=1) directory";
  }
  EXPECT_EQ(copy_file(dir.file("src"), dir.file("whole")), CopyMethod::kReflink);
  std::vector<char> got = read_file(dir.file("dst"));
  ASSERT_EQ(got.size(), 8192u + (2 << 20));
  EXPECT_TRUE(std::equal(got.begin() + 8192, got.end(), bytes.begin() + (1 << 20)));
  EXPECT_EQ(read_file(dir.file("whole")), bytes);
}

}  // namespace
}  // namespace statepager
