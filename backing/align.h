// align_up: `n` rounded up to a multiple of `to` (> 0). The one rounding every layer
// uses: file blocks, pages, staging slots.
#pragma once

#include <cstdint>

namespace statepager {

constexpr uint64_t align_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

}  // namespace statepager
