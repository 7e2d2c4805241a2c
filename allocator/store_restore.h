// restore_extents: a checkpoint's bytes copied into a Pager's tiers, the inverse of
// StoreSnapshot (allocator/store_snapshot.h).
//
// Extent i becomes HOST or FILE with the store_bytes found at src_offsets[i] of the file
// `src`, or ZERO when zero[i]. Extents must be at rest, not held and in no epoch (UsageError); each
// is 'paging_in' while its bytes are copied. All or nothing: the bytes go to fresh ranges
// of the host tier while it has room, else of the store (Pager::begin_restore), and the
// extents switch to them (HOST or FILE) once every copy has succeeded; on an error nothing
// changed. Nothing goes through the device.
//
// Thread-safety: that of the Pager; the copies run on the calling thread and up to
// kCopyThreads - 1 more (backing/file_copy.h), which have ended when it returns.
// Errors: UsageError for mismatched arguments or an extent given twice; those of
// Pager::begin_restore() and of copy_range() (backing/file_copy.h), e.g. CorruptStoreError
// for a short `src`, NoSpaceError.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "allocator/pager.h"
#include "backing/file_copy.h"

namespace statepager {

// Returns the last resort any extent's copy came to (kReadWrite where one fell back to it).
CopyMethod restore_extents(Pager& pager, const std::vector<ExtentId>& ids,
                           const std::vector<bool>& zero, const std::string& src,
                           const std::vector<uint64_t>& src_offsets);

}  // namespace statepager
