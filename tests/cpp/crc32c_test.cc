// crc32c: the published check values, the CPU instruction against the table, chaining,
// ChunkCrcs' chunk boundaries, and copy_range checksumming what it copies by each method.
#include "backing/crc32c.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "backing/errors.h"
#include "backing/file_copy.h"
#include "tests/cpp/temp_dir.h"

namespace statepager {
namespace {

std::vector<unsigned char> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> out(n);
  for (auto& c : out) c = static_cast<unsigned char>(rng());
  return out;
}

// RFC 3720 (iSCSI) B.4 and the usual "123456789" check value.
TEST(Crc32c, KnownAnswers) {
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xFF), up(32), down(32);
  for (int i = 0; i < 32; i++) {
    up[i] = static_cast<unsigned char>(i);
    down[i] = static_cast<unsigned char>(31 - i);
  }
  for (auto fn : {crc32c, crc32c_table}) {
    EXPECT_EQ(fn(0, "123456789", 9), 0xE3069283u);
    EXPECT_EQ(fn(0, zeros.data(), 32), 0x8A9136AAu);
    EXPECT_EQ(fn(0, ones.data(), 32), 0x62A8AB43u);
    EXPECT_EQ(fn(0, up.data(), 32), 0x46DD794Eu);
    EXPECT_EQ(fn(0, down.data(), 32), 0x113FDB5Cu);
    EXPECT_EQ(fn(0, "", 0), 0u);
  }
}

TEST(Crc32c, EngineMatchesTableAndChains) {
  const std::vector<unsigned char> data = random_bytes(100003, 1);
  const uint32_t whole = crc32c_table(0, data.data(), data.size());
  std::mt19937_64 rng(2);
  for (int i = 0; i < 50; i++) {  // every alignment and tail length, split anywhere
    const size_t from = rng() % 64, cut = from + rng() % (data.size() - from);
    const uint32_t a = crc32c(0, data.data() + from, cut - from);
    EXPECT_EQ(a, crc32c_table(0, data.data() + from, cut - from));
    EXPECT_EQ(crc32c(a, data.data() + cut, data.size() - cut),
              crc32c_table(0, data.data() + from, data.size() - from));
  }
  EXPECT_EQ(crc32c(0, data.data(), data.size()), whole);
  const std::string engine = crc32c_engine();
  EXPECT_TRUE(engine == "sse4.2" || engine == "armv8-crc" || engine == "table") << engine;
}

// The instruction path sums blocks of 3 x 8 KiB as three chains and joins them: lengths
// around the blocks' multiples, from every 8-byte alignment, chained from a nonzero crc.
TEST(Crc32c, EngineMatchesTableAroundItsBlocks) {
  const size_t block = 3 * 8192;
  const std::vector<unsigned char> data = random_bytes(3 * block + 64, 6);
  for (size_t length : {block - 1, block, block + 1, 2 * block - 8, 2 * block + 9, 3 * block}) {
    for (size_t from : {size_t(0), size_t(3), size_t(8), size_t(61)}) {
      EXPECT_EQ(crc32c(0x12345678, data.data() + from, length),
                crc32c_table(0x12345678, data.data() + from, length))
          << length << " from " << from;
    }
  }
}

TEST(Crc32c, ChunkCrcsSplitsAtChunkBoundaries) {
  const size_t chunk = 4096 + 7;
  const std::vector<unsigned char> data = random_bytes(5 * chunk + 123, 3);
  std::vector<uint32_t> want;
  for (size_t at = 0; at < data.size(); at += chunk) {
    want.push_back(crc32c(0, data.data() + at, std::min(chunk, data.size() - at)));
  }
  ChunkCrcs crcs(chunk);
  std::mt19937_64 rng(4);
  for (size_t at = 0; at < data.size();) {  // pieces that straddle chunk boundaries
    const size_t n = std::min<size_t>(1 + rng() % (2 * chunk), data.size() - at);
    crcs.update(data.data() + at, n);
    at += n;
  }
  EXPECT_EQ(crcs.take(), want);
  EXPECT_TRUE(crcs.take().empty());  // started over
  crcs.update(data.data(), chunk);   // exactly one chunk: no empty one after it
  EXPECT_EQ(crcs.take(), std::vector<uint32_t>{want[0]});
  EXPECT_THROW(ChunkCrcs(0), UsageError);
}

// Whatever method copies, the crcs are those of the bytes copied; a byte changed in the
// source changes the crc of its chunk only.
TEST(Crc32c, CopyRangeChecksumsWhatItCopies) {
  TempDir dir;
  const size_t total = 3 << 20, chunk = 1 << 20;
  std::vector<unsigned char> bytes = random_bytes(total, 5);
  const std::string src_path = dir.path() + "/src", dst_path = dir.path() + "/dst";
  auto write_src = [&] {
    std::ofstream(src_path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(total));
  };
  write_src();
  std::vector<uint32_t> want;
  for (size_t at = 4096; at < total; at += chunk) {
    want.push_back(crc32c(0, bytes.data() + at, std::min(chunk, total - at)));
  }
  for (CopyMethod first : {CopyMethod::kReflink, CopyMethod::kCopyFileRange,
                           CopyMethod::kReadWrite}) {
    const OpenFile src(src_path, OpenFile::kRead), dst(dst_path, OpenFile::kWrite);
    ChunkCrcs crcs(chunk);
    const CopyMethod used = copy_range(src, 4096, dst, 8192, total - 4096, first, &crcs);
    EXPECT_EQ(crcs.take(), want) << copy_method_name(first);
    // Bytes that move pass through the buffer; only a reflink keeps its method.
    EXPECT_TRUE(used == CopyMethod::kReadWrite || used == CopyMethod::kReflink);
  }
  bytes[4096 + chunk + 10] ^= 1;
  write_src();
  const OpenFile src(src_path, OpenFile::kRead), dst(dst_path, OpenFile::kWrite);
  ChunkCrcs crcs(chunk);
  copy_range(src, 4096, dst, 8192, total - 4096, CopyMethod::kReadWrite, &crcs);
  const std::vector<uint32_t> got = crcs.take();
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(got[0], want[0]);
  EXPECT_NE(got[1], want[1]);
  EXPECT_EQ(got[2], want[2]);
}

}  // namespace
}  // namespace statepager
