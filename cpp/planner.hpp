// Block planner for popxl_flash: the static block schedule of a FlashAttention mask.
//
// Visibility (bottom-right aligned, FlashAttention >= 2.1): with shift = Lkv - Lq, query row i
// sees key column j iff
//   causal:          j <= i + shift
//   window left:     i + shift - left  <= j      (left  >= 0; kUnbounded = no bound)
//   window right:    j <= i + shift + right      (right >= 0; kUnbounded = no bound)
// and all given conditions hold. Rows i >= Lq and columns j >= Lkv (tail-chunk padding) are
// never visible. Every query row therefore sees one contiguous band of columns.
//
// No Python here: the pybind11 layer (bindings.cpp) wraps planBlocks().
#pragma once

#include <cstdint>
#include <vector>

namespace popxl_flash {

// Window side value meaning "no bound on this side" (FlashAttention's spelling).
constexpr int64_t kUnbounded = -1;

enum class BlockKind : int8_t { Skip = 0, Full = 1, Partial = 2 };

// Sentinel pattern id of blocks that are not partial.
constexpr int32_t kNoPattern = -1;

struct PlanRequest {
    int64_t lq = 0;
    int64_t lkv = 0;
    int64_t chunk_q = 0;
    int64_t chunk_kv = 0;
    bool causal = true;
    int64_t window_left = kUnbounded;
    int64_t window_right = kUnbounded;
};

struct BlockPlan {
    int64_t nq = 0;   // ceil(lq / chunk_q)
    int64_t nkv = 0;  // ceil(lkv / chunk_kv)
    std::vector<int8_t> kind;             // [nq * nkv] row-major, BlockKind values
    std::vector<int32_t> pattern_id;      // [nq * nkv] row-major, kNoPattern unless partial
    int64_t num_patterns = 0;             // P
    std::vector<uint8_t> patterns;        // [P * chunk_q * chunk_kv], 1 = visible
    std::vector<int32_t> visited_per_q;   // [nq] non-skip blocks per q chunk
    std::vector<int32_t> empty_rows;      // real query rows that see no key, ascending
    int64_t visible_elements = 0;
    int64_t visited_blocks = 0;
    int64_t full_blocks = 0;
    int64_t partial_blocks = 0;
};

// Plans the block schedule. Throws std::invalid_argument on an invalid request and
// std::length_error when an index output would not fit its int32 table.
BlockPlan planBlocks(const PlanRequest& request);

}  // namespace popxl_flash
