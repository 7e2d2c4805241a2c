#include "allocator/store_tier.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "backing/align.h"
#include "backing/crc32c.h"
#include "backing/errors.h"
#include "backing/parallel.h"

namespace statepager {

namespace {

constexpr size_t kCrcParts = 4096;  // a mapped batch's pieces, at most: its checksums' room

// The crc32c of each of the chunk's parts (Job::crc_ranges) as its bytes lie in memory:
// `staging` (the slot's buffer) or the chunk's host-tier memory.
void checksum(Job& job, const Chunk& chunk, const char* staging) {
  auto part = [&](size_t k, const char* at) {
    job.part_crcs[k] = crc32c(0, at, job.part_bytes[k]);
    job.part_known[k] = 1;
  };
  if (chunk.buf != nullptr) {
    part(chunk.first_part, chunk.buf);
    return;
  }
  for (size_t i = 0; i < chunk.pieces.size(); i++) {
    part(chunk.first_part + i, staging + chunk.pieces[i].buf_offset);
  }
}

}  // namespace

StoreTier::StoreTier(Device& device, UringFile& file, unsigned depth, size_t block_bytes,
                     bool map_ram)
    : device_(device), file_(file), block_bytes_(block_bytes) {
  if (map_ram) ram_ = std::make_unique<RamMap>(device_, file_);
  crc_threads_ = std::clamp(std::thread::hardware_concurrency() / 2, 1u, 8u);
  staging_ = static_cast<char*>(device_.alloc_staging(size_t(depth) * block_bytes_));
  for (unsigned i = 0; i < depth; i++) {
    StagingSlot slot;
    slot.index = i;
    slot.buf = staging_ + size_t(i) * block_bytes_;
    slots_.push_back(slot);
  }
  try {
    file_.register_buffers({iovec{staging_, slots_.size() * block_bytes_}});
  } catch (const Error&) {
    // Registration needs RLIMIT_MEMLOCK headroom; unregistered I/O is correct, just slower.
  }
}

StoreTier::~StoreTier() {
  ram_.reset();  // unregistered before the device's other memory goes
  for (uint32_t* block : crc_blocks_) {
    try {
      device_.free_staging(block, kCrcParts * 4);
    } catch (...) {
    }
  }
  try {
    device_.free_staging(staging_, slots_.size() * block_bytes_);
  } catch (...) {
  }
}

void StoreTier::plan(Job& job, std::vector<Move> moves) const {
  std::sort(moves.begin(), moves.end(),
            [](const Move& a, const Move& b) { return a.store_offset < b.store_offset; });
  const size_t block = block_bytes_;
  Chunk chunk;
  auto flush = [&] {
    if (chunk.file_bytes > 0) job.chunks.push_back(std::move(chunk));
    chunk = Chunk{};
  };
  for (const Move& m : moves) {
    // Its checksum covers its bytes and their last block's zeros, as a page-in reads them.
    const size_t first_part = job.part_bytes.size();
    const size_t crc_bytes = align_up(m.bytes, kFileAlign);
    if (m.buf != nullptr) {  // its own requests: host ranges are not neighbours in the file
      flush();
      for (size_t pos = 0; pos < m.file_bytes; pos += block) {
        job.chunks.push_back(Chunk{m.store_offset + pos, std::min(block, m.file_bytes - pos),
                                   {}, m.buf + pos, job.part_bytes.size()});
        job.part_bytes.push_back(pos < crc_bytes ? std::min(block, crc_bytes - pos) : 0);
      }
    }
    size_t pos = m.buf != nullptr ? m.bytes : 0;
    while (pos < m.bytes) {
      const uint64_t at = m.store_offset + pos;
      if (chunk.file_bytes == block ||
          (chunk.file_bytes > 0 && chunk.store_offset + chunk.file_bytes != at)) {
        flush();
      }
      if (chunk.file_bytes == 0) {
        chunk.store_offset = at;
        chunk.first_part = job.part_bytes.size();
      }
      const size_t n = std::min(block - chunk.file_bytes, m.bytes - pos);
      chunk.pieces.push_back(StagingCopy{chunk.file_bytes, m.addr + pos, n});
      job.part_bytes.push_back(align_up(n, kFileAlign));
      chunk.file_bytes += align_up(n, kFileAlign);
      pos += n;
    }
    const uint64_t end = m.store_offset + m.file_bytes;
    if (job.file_ends.empty() || store_index(job.file_ends.back()) != store_index(end - 1)) {
      job.file_ends.push_back(end);  // sorted by offset: stores come one after another
    } else {
      job.file_ends.back() = std::max(job.file_ends.back(), end);
    }
    job.bytes_moved += m.bytes;
    if (job.part_bytes.size() > first_part) {
      job.crc_ranges.push_back(
          RangeCrc{m.store_offset, first_part, job.part_bytes.size() - first_part});
    }
  }
  flush();
  job.part_crcs.resize(job.part_bytes.size());
  job.part_known.resize(job.part_bytes.size(), 0);
}

void StoreTier::start(Job& job) {
  if (job.out()) {
    for (uint64_t end : job.file_ends) file_.allocate(end);
  }
  if (ram_) {
    for (uint64_t end : job.file_ends) ram_->grow(store_index(end - 1));
  }
}

void StoreTier::punch(uint64_t offset, uint64_t length) {
  if (ram_) {
    ram_->punch(offset, length);
  } else {
    file_.punch(offset, length);
  }
}

uint64_t StoreTier::mapped_bytes() const { return ram_ ? ram_->mapped_bytes() : 0; }

bool StoreTier::pump(const std::vector<Job*>& jobs, bool progressed) {
  bool copies_pending = false;
  if (ram_) {
    for (Job* job : jobs) progressed |= start_mapped(*job);
  }
  for (StagingSlot& slot : slots_) {
    if (slot.job) continue;
    for (Job* job : jobs) {
      if (job->phase == JobPhase::kQueued || job->error ||
          job->next_chunk == job->chunks.size()) {
        continue;
      }
      slot.job = job;
      slot.chunk = &job->chunks[job->next_chunk++];
      job->chunks_in_flight++;
      start_chunk(slot);
      progressed = true;
      break;
    }
  }
  for (auto it = mapped_.begin(); it != mapped_.end();) {
    bool done = true;  // its copies and its checksums
    for (std::optional<Fence>* f : {&it->copy, &it->sums}) {
      if (*f && !copied(*f, *it->job, &copies_pending)) done = false;
    }
    if (!done) {
      ++it;
      continue;
    }
    settle_mapped(*it);
    it->job->chunks_in_flight -= it->chunks;  // their bytes are where they go
    it = mapped_.erase(it);
    progressed = true;
  }
  for (StagingSlot& slot : slots_) {
    if (!slot.copy) continue;
    if (!copied(slot.copy, *slot.job, &copies_pending)) continue;
    progressed = true;
    if (slot.job->out() && !slot.job->error) {
      checksum(*slot.job, *slot.chunk, slot.buf);  // the bytes as the file gets them
      file_.submit(UringFile::Request{slot.index, true, slot.buf, slot.chunk->file_bytes,
                                      slot.chunk->store_offset, 0});
    } else {
      finish_slot(slot, 0, 0);
    }
  }
  std::vector<UringFile::Completion> done;
  if (file_.in_flight() > 0) {
    const int64_t timeout_us = progressed ? 0 : copies_pending ? 20 : 500;
    file_.reap(&done, timeout_us);
  }
  for (const auto& c : done) {
    progressed = true;
    StagingSlot& slot = slots_[c.tag];
    slot.job->requests++;
    if (c.error == 0 && !slot.job->out() && !slot.job->error) {
      checksum(*slot.job, *slot.chunk, slot.buf);  // the bytes as the file held them
    }
    if (c.error == 0 && !slot.job->out() && !slot.job->error && slot.chunk->buf == nullptr) {
      try {
        CopyList copies;  // the pieces, rounded (see the header), joined where they can be
        for (const StagingCopy& p : slot.chunk->pieces) {
          copies.add(p.addr, slot.buf + p.buf_offset, align_up(p.bytes, kFileAlign), staging_);
        }
        device_.copy_batch(CopyQueue::kToDevice, copies.copies().data(), copies.copies().size());
        slot.copy = device_.record(CopyQueue::kToDevice);
        continue;
      } catch (...) {
        slot.job->error = std::current_exception();
        if (hold_for_copies(slot, CopyQueue::kToDevice)) continue;
      }
    }
    finish_slot(slot, c.error, c.offset);
  }
  return progressed;
}

void StoreTier::start_chunk(StagingSlot& slot) {
  const Chunk& chunk = *slot.chunk;
  try {
    if (chunk.buf != nullptr) {
      if (slot.job->out()) checksum(*slot.job, chunk, nullptr);
      file_.submit(UringFile::Request{slot.index, slot.job->out(), chunk.buf, chunk.file_bytes,
                                      chunk.store_offset, -1});
    } else if (slot.job->out()) {
      size_t at = 0;
      for (const StagingCopy& p : chunk.pieces) {
        std::memset(slot.buf + at, 0, p.buf_offset - at);  // padding between extents
        device_.copy_to_host(slot.buf + p.buf_offset, p.addr, p.bytes);
        at = p.buf_offset + p.bytes;
      }
      std::memset(slot.buf + at, 0, chunk.file_bytes - at);
      slot.copy = device_.record(CopyQueue::kToHost);
    } else {
      file_.submit(UringFile::Request{slot.index, false, slot.buf, chunk.file_bytes,
                                      chunk.store_offset, 0});
    }
  } catch (...) {
    slot.job->error = std::current_exception();
    if (!hold_for_copies(slot, slot.job->out() ? CopyQueue::kToHost : CopyQueue::kToDevice)) {
      finish_slot(slot, 0, 0);
    }
  }
}

// After a chunk failed partway: copies it queued before the failure may still run into
// its job's memory (device pages a failed page-in lets go, mapped store pages), so the
// slot is let go once they are done, by a fence (pump() then finishes it). False where
// no fence can be recorded either (a failed device: close() synchronizes).
bool StoreTier::hold_for_copies(StagingSlot& slot, CopyQueue queue) {
  try {
    slot.copy = device_.record(queue);
    return true;
  } catch (...) {
    return false;
  }
}

// Whether the device copy `copy` is done (then released and reset); a failed device
// becomes `job`'s error and counts as done. Sets *pending while it is not.
bool StoreTier::copied(std::optional<Fence>& copy, Job& job, bool* pending) {
  try {
    if (!device_.is_done(*copy)) {
      *pending = true;
      return false;
    }
  } catch (...) {
    job.error = std::current_exception();
  }
  device_.release_fence(*copy);
  copy.reset();
  return true;
}

// Queues the device copies of `job`'s next chunks whose store ranges are mapped (RamMap),
// up to the first that is not (a staging slot takes that one) or kCrcParts pieces,
// together under one fence, with the device's checksums of their pieces: a mapped chunk
// needs no staging, so it does not wait for a slot, and the copy engines see a bucket's
// copies at once rather than a slot's worth at a time. Returns whether it queued any. If
// queuing fails, its chunks are counted queued, the job failed, and the fence holds them
// like the rest (some copies may still run into the job's memory).
bool StoreTier::start_mapped(Job& job) {
  if (job.phase == JobPhase::kQueued || job.error) return false;
  CopyList copies;
  std::vector<RamMap::Piece> mem;
  std::vector<DeviceRange> sums;
  size_t queued = 0;
  for (; job.next_chunk < job.chunks.size(); job.next_chunk++, queued++) {
    const Chunk& chunk = job.chunks[job.next_chunk];
    mem.clear();
    if (chunk.buf != nullptr || sums.size() + chunk.pieces.size() > kCrcParts ||
        !ram_->resolve(chunk.store_offset, chunk.file_bytes, &mem)) {
      break;
    }
    add_mapped_copies(job.out(), chunk, mem, &copies);
    for (const StagingCopy& p : chunk.pieces) {
      job.mapped_bytes += p.bytes;
      // What a page-out reads, what a page-in writes (the part's whole blocks).
      sums.push_back(DeviceRange{p.addr, job.out() ? p.bytes : align_up(p.bytes, kFileAlign)});
    }
  }
  if (queued == 0) return false;
  job.chunks_in_flight += queued;
  const CopyQueue queue = job.out() ? CopyQueue::kToHost : CopyQueue::kToDevice;
  MappedCopies batch{&job, job.next_chunk - queued, queued, std::nullopt, std::nullopt, nullptr};
  try {
    device_.copy_batch(queue, copies.copies().data(), copies.copies().size());
    batch.crcs = take_crc_block();
    batch.sums = device_.checksum(queue, sums.data(), sums.size(), batch.crcs);
    if (!batch.sums) give_crc_block(std::exchange(batch.crcs, nullptr));  // the pages', then
  } catch (...) {
    job.error = std::current_exception();
    batch.crcs = nullptr;  // a failed checksum() may still write it: never handed out again
  }
  try {
    batch.copy = device_.record(queue);
  } catch (...) {
    if (!job.error) job.error = std::current_exception();
    job.chunks_in_flight -= queued;  // no fence to wait for (close() synchronizes)
    if (batch.sums) device_.release_fence(*batch.sums);
    return true;
  }
  mapped_.push_back(std::move(batch));
  return true;
}

uint32_t* StoreTier::take_crc_block() {
  if (free_crc_blocks_.empty()) {
    crc_blocks_.push_back(static_cast<uint32_t*>(device_.alloc_staging(kCrcParts * 4)));
    return crc_blocks_.back();
  }
  uint32_t* block = free_crc_blocks_.back();
  free_crc_blocks_.pop_back();
  return block;
}

void StoreTier::give_crc_block(uint32_t* block) { free_crc_blocks_.push_back(block); }

// A finished mapped batch's checksums into its job's parts: the device's, a page-out's
// joined with the zeros its copies put after each piece; or, where the device took none,
// the files' pages' (checksum_mapped).
void StoreTier::settle_mapped(MappedCopies& batch) {
  Job& job = *batch.job;
  if (batch.crcs == nullptr) {
    if (!job.error) checksum_mapped(batch);
    return;
  }
  static const std::vector<char> zeros(kFileAlign);
  size_t j = 0;
  for (size_t c = batch.first; c < batch.first + batch.chunks && !job.error; c++) {
    const Chunk& chunk = job.chunks[c];
    for (size_t i = 0; i < chunk.pieces.size(); i++, j++) {
      const size_t part = chunk.first_part + i;
      uint32_t crc = batch.crcs[j];
      const size_t pad = job.part_bytes[part] - chunk.pieces[i].bytes;
      if (job.out() && pad > 0) crc = crc32c_combine(crc, crc32c(0, zeros.data(), pad), pad);
      job.part_crcs[part] = crc;
      job.part_known[part] = 1;
    }
  }
  give_crc_block(std::exchange(batch.crcs, nullptr));
}

// The crc32c of each part of a mapped batch's chunks as the files' pages hold them once
// its copies are done (what a page-out wrote there, what a page-in read from there), for
// a device that cannot take them itself (see Note [Store checksums]). A part is cut into
// spans of at most kCrcSpan, checksummed on up to crc_threads_ threads (one core's crc32c
// is slower than the copy engines) and joined.
void StoreTier::checksum_mapped(const MappedCopies& batch) {
  constexpr size_t kCrcSpan = size_t(4) << 20;
  struct Span {
    size_t part;
    const char* host;
    size_t bytes;
    uint32_t crc = 0;
  };
  Job& job = *batch.job;
  std::vector<Span> spans;
  std::vector<RamMap::Piece> mem;
  for (size_t c = batch.first; c < batch.first + batch.chunks; c++) {
    const Chunk& chunk = job.chunks[c];
    for (size_t i = 0; i < chunk.pieces.size(); i++) {
      const size_t part = chunk.first_part + i;
      mem.clear();
      if (!ram_->resolve(chunk.store_offset + chunk.pieces[i].buf_offset, job.part_bytes[part],
                         &mem)) {
        continue;  // not known: copied, so mapped; never here
      }
      for (const RamMap::Piece& m : mem) {
        for (size_t at = 0; at < m.bytes; at += kCrcSpan) {
          spans.push_back(Span{part, m.host + at, std::min(kCrcSpan, m.bytes - at)});
        }
      }
    }
  }
  try {
    parallel_for(spans.size(), crc_threads_,
                 [&](size_t k) { spans[k].crc = crc32c(0, spans[k].host, spans[k].bytes); });
  } catch (...) {
    job.error = std::current_exception();  // no thread to be had at all
    return;
  }
  for (size_t k = 0; k < spans.size(); k++) {
    const bool first = k == 0 || spans[k - 1].part != spans[k].part;
    uint32_t& crc = job.part_crcs[spans[k].part];
    crc = first ? spans[k].crc : crc32c_combine(crc, spans[k].crc, spans[k].bytes);
    job.part_known[spans[k].part] = 1;
  }
}

// Adds one mapped chunk's copies to *copies: each piece straight between device memory
// and the files' pages `mem` (the chunk's store range, in order), joined to the copy
// before where it continues it (an extent across chunks of an unstriped file goes as one
// copy: see UringFile's Striping; small neighbours, rounded on page-in, as one too). A
// page-out also zeroes the bytes between and after them (a store range holds zeros past
// its extent's bytes, as the staging path writes them).
void StoreTier::add_mapped_copies(bool out, const Chunk& chunk,
                                  const std::vector<RamMap::Piece>& mem, CopyList* copies) {
  // Calls f(piece, host, done, k) over the chunk's bytes [at, at + n), k at a time (as
  // `mem` cuts them), `done` of them before.
  size_t m = 0, m_start = 0;  // mem[m] holds the chunk's bytes from m_start on
  auto each = [&](size_t at, size_t n, auto&& f) {
    if (n == 0) return;
    while (m_start + mem[m].bytes <= at) m_start += mem[m++].bytes;
    for (size_t done = 0; done < n;) {
      if (m_start + mem[m].bytes <= at + done) m_start += mem[m++].bytes;
      const size_t k = std::min(n - done, m_start + mem[m].bytes - (at + done));
      f(mem[m], mem[m].host + (at + done - m_start), done, k);
      done += k;
    }
  };
  auto zero = [](const RamMap::Piece&, char* h, size_t, size_t k) { std::memset(h, 0, k); };
  size_t at = 0;
  for (const StagingCopy& p : chunk.pieces) {
    if (out) each(at, p.buf_offset - at, zero);
    const size_t n = out ? p.bytes : align_up(p.bytes, kFileAlign);  // see the header
    each(p.buf_offset, n, [&](const RamMap::Piece& in, char* h, size_t done, size_t k) {
      copies->add(p.addr + done, h, k, in.mapping);
    });
    at = p.buf_offset + n;
  }
  if (out) each(at, chunk.file_bytes - at, zero);
}

void StoreTier::finish_slot(StagingSlot& slot, int error, uint64_t offset) {
  Job& job = *slot.job;
  if (error != 0 && !job.error) {
    try {
      // UringFile's files never move: their paths are safe to read here.
      const std::string& path = file_.file_path(store_index(offset));
      if (error == ENODATA) {
        throw CorruptStoreError("store file " + path + " is truncated at offset " +
                                std::to_string(offset % UringFile::kRegionBytes) +
                                ": it holds fewer bytes than were paged out there. The store "
                                "was changed outside statepager; its state is lost.");
      }
      throw_io_error(error, job.out() ? "page-out write" : "page-in read", path,
                     offset % UringFile::kRegionBytes);
    } catch (...) {
      job.error = std::current_exception();
    }
  }
  job.chunks_in_flight--;
  slot.job = nullptr;
  slot.chunk = nullptr;
}

}  // namespace statepager
