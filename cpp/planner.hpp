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

// How a partial block is executed. With h = chunk_q / 2 and w = chunk_kv / 2 (both >= 1):
//   Whole: one masked chunk_q x chunk_kv block (also every full block).
//   Lower: its top-right quadrant (rows < h, cols >= w) holds no visible cell; it runs as two
//          sub-blocks, rows [0, h) x cols [0, w) and rows [h, chunk_q) x cols [0, chunk_kv)
//          (a causal diagonal block).
//   Upper: its bottom-left quadrant (rows >= h, cols < w) holds no visible cell; it runs as
//          rows [0, h) x cols [0, chunk_kv) and rows [h, chunk_q) x cols [w, chunk_kv)
//          (the left edge of a window).
// Lower is preferred when both quadrants are empty.
enum class BlockSplit : int8_t { Whole = 0, Lower = 1, Upper = 2 };

// The visited blocks of one loop nest, flattened in execution order (one entry per block).
struct BlockList {
    std::vector<int32_t> q_chunk;     // q chunk of each step
    std::vector<int32_t> kv_chunk;    // kv chunk of each step
    std::vector<int8_t> kind;         // Full or Partial (never Skip)
    std::vector<int32_t> pattern_id;  // kNoPattern unless partial
    std::vector<int8_t> split;        // BlockSplit values
    std::vector<uint8_t> first;       // 1 at the first step of an outer chunk
    std::vector<uint8_t> last;        // 1 at the last step of an outer chunk
};

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
    // [P * 4] canonical keys (rows', cols', lo, hi) of the distinct patterns, by id: pattern p
    // holds cell (r, c) iff r < rows', c < cols' and lo <= c - r <= hi (planner.cpp). The
    // cells themselves are never built here (O(P * chunk_q * chunk_kv)); the Python face
    // builds them on demand for the graph code.
    std::vector<int64_t> pattern_keys;
    std::vector<int8_t> split;            // [nq * nkv] row-major, BlockSplit values
    std::vector<int32_t> visited_per_q;   // [nq] non-skip blocks per q chunk
    // The real query rows that see no key are [0, empty_rows_before) and [empty_rows_from, Lq)
    // (closed form: every row sees one contiguous band, see the file comment).
    int64_t empty_rows_before = 0;
    int64_t empty_rows_from = 0;
    int64_t visible_elements = 0;         // closed form, no per-row work
    int64_t visited_blocks = 0;
    int64_t full_blocks = 0;
    int64_t partial_blocks = 0;
    int64_t executed_elements = 0;        // (q, k) cells the block matmuls run on
    BlockList q_major;                    // forward order: q chunk outer, kv chunk inner
    BlockList kv_major;                   // backward order: kv chunk outer, q chunk inner
};

// Plans the block schedule in O(nq * nkv) time and memory (no per-row or per-element work).
// Throws std::invalid_argument on an invalid request and
// std::length_error when an index output would not fit its int32 table.
BlockPlan planBlocks(const PlanRequest& request);

}  // namespace popxl_flash
