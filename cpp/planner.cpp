// Block planner: classify -> dedupe -> tables.
//
// The seed's insight (getTriuOffsetSequence in the PopART op), generalised: inside a block whose
// first query row is q0 and first key column is k0, the local cell (r, c) is global (q0 + r, k0 + c),
// and every mask condition is a condition on the global diagonal j - i - shift only. With the
// block's diagonal offset
//     offset = (q0 + shift) - k0,
// the cell is visible iff  band.low <= c - r - offset <= band.high.  So the pattern of a causal or
// window block depends only on its diagonal offset and its valid extents (rows < Lq, columns < Lkv
// in a padded tail chunk). The seed only enumerated the offsets of causal Lq == Lkv square-ish
// tilings and looped forever when the kv chunk length was 1; here the offset comes closed-form from
// each block's corner, so there is no search at all.
//
// (offset, valid rows, valid cols) determines the pattern but is not injective: a band clipped by
// the block edge, or a padded tail, can give equal contents for different offsets or extents. The
// dedupe key is therefore canonical: shrink the valid rectangle to the smallest top-left
// rectangle [0, rows') x [0, cols') that still holds every visible cell, then clip the band to
// the local diagonals that rectangle holds, [1 - rows', cols' - 1]. The visible set is exactly
// band intersected with that rectangle, and every diagonal of the clipped span holds a visible cell, so equal keys
// <=> equal contents: deduplicating by this key is deduplicating by content.
#include "planner.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>

namespace popxl_flash {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// Allowed values of (j - i - shift): [low, high], each side possibly unbounded.
struct DiagonalBand {
    bool has_low = false;
    int64_t low = 0;
    bool has_high = false;
    int64_t high = 0;
};

// The valid (unpadded) part of one block.
struct BlockExtent {
    int64_t q0 = 0;
    int64_t k0 = 0;
    int64_t rows = 0;  // valid query rows, 1..chunk_q
    int64_t cols = 0;  // valid key columns, 1..chunk_kv
};

// Local diagonals (c - r) that are visible inside a block, clipped to the valid rectangle.
// Empty (lo > hi) for a skipped block.
struct LocalSpan {
    int64_t lo = 0;
    int64_t hi = -1;
    bool empty() const { return lo > hi; }
};

// Canonical dedupe key of a partial block (see the file comment).
struct PatternKey {
    int64_t rows = 0;  // rows'  = last row holding a visible cell + 1
    int64_t cols = 0;  // cols'  = last column holding a visible cell + 1
    int64_t lo = 0;    // visible local diagonals, clipped to [1 - rows', cols' - 1]
    int64_t hi = 0;
    bool operator<(const PatternKey& o) const {
        return std::tie(rows, cols, lo, hi) < std::tie(o.rows, o.cols, o.lo, o.hi);
    }
};

void require(bool ok, const std::string& message) {
    if (!ok) throw std::invalid_argument(message);
}

void validate(const PlanRequest& req) {
    require(req.lq >= 1, "Lq=" + std::to_string(req.lq) + " must be >= 1");
    require(req.lkv >= 1, "Lkv=" + std::to_string(req.lkv) + " must be >= 1");
    require(req.chunk_q >= 1 && req.chunk_q <= req.lq,
            "chunk_q=" + std::to_string(req.chunk_q) + " must be in 1..Lq=" + std::to_string(req.lq));
    require(req.chunk_kv >= 1 && req.chunk_kv <= req.lkv,
            "chunk_kv=" + std::to_string(req.chunk_kv) + " must be in 1..Lkv=" +
                std::to_string(req.lkv));
    require(req.window_left >= kUnbounded && req.window_right >= kUnbounded,
            "window=(" + std::to_string(req.window_left) + ", " +
                std::to_string(req.window_right) + ") sides must be >= -1 (-1 = unbounded)");
}

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

DiagonalBand bandOf(const PlanRequest& req) {
    DiagonalBand band;
    if (req.window_left != kUnbounded) {
        band.has_low = true;
        band.low = -req.window_left;
    }
    if (req.causal) {
        band.has_high = true;
        band.high = 0;
    }
    if (req.window_right != kUnbounded) {
        band.high = band.has_high ? std::min(band.high, req.window_right) : req.window_right;
        band.has_high = true;
    }
    return band;
}

BlockExtent extentOf(const PlanRequest& req, int64_t bi, int64_t bj) {
    BlockExtent e;
    e.q0 = bi * req.chunk_q;
    e.k0 = bj * req.chunk_kv;
    e.rows = std::min(req.chunk_q, req.lq - e.q0);
    e.cols = std::min(req.chunk_kv, req.lkv - e.k0);
    return e;
}

// ---- classify --------------------------------------------------------------------------------

LocalSpan localSpan(const DiagonalBand& band, const BlockExtent& e, int64_t shift) {
    const int64_t offset = (e.q0 + shift) - e.k0;  // the block's diagonal offset
    LocalSpan span{1 - e.rows, e.cols - 1};
    if (band.has_low) span.lo = std::max(span.lo, offset + band.low);
    if (band.has_high) span.hi = std::min(span.hi, offset + band.high);
    return span;
}

// Closed-form per block: no per-element work.
BlockKind classify(const PlanRequest& req, const BlockExtent& e, const LocalSpan& span) {
    if (span.empty()) return BlockKind::Skip;
    const bool unpadded = e.rows == req.chunk_q && e.cols == req.chunk_kv;
    const bool whole_band = span.lo == 1 - e.rows && span.hi == e.cols - 1;
    return unpadded && whole_band ? BlockKind::Full : BlockKind::Partial;
}

// ---- dedupe ----------------------------------------------------------------------------------

// Closed form: in a non-skip block, row r has visible cells iff -hi <= r <= cols - 1 - lo, and the
// last visible column of the last visible row is the rightmost visible column overall.
PatternKey canonicalKey(const BlockExtent& e, const LocalSpan& span) {
    PatternKey key;
    const int64_t last_row = std::min(e.rows - 1, e.cols - 1 - span.lo);
    const int64_t last_col = std::min(e.cols - 1, last_row + span.hi);
    key.rows = last_row + 1;
    key.cols = last_col + 1;
    key.lo = std::max(span.lo, 1 - key.rows);
    key.hi = std::min(span.hi, key.cols - 1);
    return key;
}

// Hands out pattern ids in first-seen order and records each distinct key once. The cells are
// not materialised: a key is O(1), a pattern O(chunk_q * chunk_kv), and a long sequence's
// candidate chunkings may have blocks of 16K x 16K cells or more.
class PatternTable {
public:
    int32_t idFor(const PatternKey& key) {
        const auto found = ids_.find(key);
        if (found != ids_.end()) return found->second;
        const auto id = static_cast<int32_t>(ids_.size());
        ids_.emplace(key, id);
        keys_.insert(keys_.end(), {key.rows, key.cols, key.lo, key.hi});
        return id;
    }

    int64_t size() const { return static_cast<int64_t>(ids_.size()); }
    std::vector<int64_t> release() { return std::move(keys_); }

private:
    std::map<PatternKey, int32_t> ids_;
    std::vector<int64_t> keys_;  // [size() * 4] in id order
};

// ---- split ----------------------------------------------------------------------------------

// True iff some valid cell of rows [r0, r1) x cols [c0, c1) of the block is visible. The
// rectangle's local diagonals c - r form the contiguous range [c0 - (r1 - 1), (c1 - 1) - r0].
bool anyVisible(const BlockExtent& e, const LocalSpan& span, int64_t r0, int64_t r1, int64_t c0,
                int64_t c1) {
    r1 = std::min(r1, e.rows);
    c1 = std::min(c1, e.cols);
    if (r0 >= r1 || c0 >= c1) return false;
    return std::max(span.lo, c0 - (r1 - 1)) <= std::min(span.hi, (c1 - 1) - r0);
}

BlockSplit splitOf(const PlanRequest& req, const BlockExtent& e, const LocalSpan& span) {
    const int64_t h = req.chunk_q / 2;
    const int64_t w = req.chunk_kv / 2;
    if (h < 1 || w < 1) return BlockSplit::Whole;
    if (!anyVisible(e, span, 0, h, w, req.chunk_kv)) return BlockSplit::Lower;
    if (!anyVisible(e, span, h, req.chunk_q, 0, w)) return BlockSplit::Upper;
    return BlockSplit::Whole;
}

// Cells the block matmuls run on for one visited block.
int64_t executedCells(const PlanRequest& req, BlockSplit split) {
    const int64_t cq = req.chunk_q, ckv = req.chunk_kv, h = cq / 2, w = ckv / 2;
    switch (split) {
        case BlockSplit::Lower: return h * w + (cq - h) * ckv;
        case BlockSplit::Upper: return h * ckv + (cq - h) * (ckv - w);
        case BlockSplit::Whole: break;
    }
    return cq * ckv;
}

// ---- tables ----------------------------------------------------------------------------------

void fillBlockTables(const PlanRequest& req, BlockPlan& plan) {
    const DiagonalBand band = bandOf(req);
    const int64_t shift = req.lkv - req.lq;
    const auto num_blocks = static_cast<size_t>(plan.nq * plan.nkv);
    plan.kind.assign(num_blocks, static_cast<int8_t>(BlockKind::Skip));
    plan.pattern_id.assign(num_blocks, kNoPattern);
    plan.split.assign(num_blocks, static_cast<int8_t>(BlockSplit::Whole));
    plan.visited_per_q.assign(static_cast<size_t>(plan.nq), 0);

    PatternTable table;
    for (int64_t bi = 0; bi < plan.nq; ++bi) {  // row-major: first-seen order of patterns
        for (int64_t bj = 0; bj < plan.nkv; ++bj) {
            const BlockExtent e = extentOf(req, bi, bj);
            const LocalSpan span = localSpan(band, e, shift);
            const BlockKind kind = classify(req, e, span);
            const auto flat = static_cast<size_t>(bi * plan.nkv + bj);
            plan.kind[flat] = static_cast<int8_t>(kind);
            if (kind == BlockKind::Skip) continue;
            plan.visited_per_q[static_cast<size_t>(bi)] += 1;
            BlockSplit split = BlockSplit::Whole;
            if (kind == BlockKind::Full) {
                plan.full_blocks += 1;
            } else {
                plan.partial_blocks += 1;
                plan.pattern_id[flat] = table.idFor(canonicalKey(e, span));
                split = splitOf(req, e, span);
                plan.split[flat] = static_cast<int8_t>(split);
            }
            plan.executed_elements += executedCells(req, split);
        }
    }
    plan.visited_blocks = plan.full_blocks + plan.partial_blocks;
    plan.num_patterns = table.size();
    plan.pattern_keys = table.release();
}

// Flattens the visited blocks, outer chunk by outer chunk (q chunks outer if q_outer), inner
// chunks ascending, and flags each outer chunk's first and last visited step.
BlockList flatten(const BlockPlan& plan, bool q_outer) {
    BlockList list;
    const auto visited = static_cast<size_t>(plan.visited_blocks);  // exact sizes: no regrowth
    for (auto* v : {&list.q_chunk, &list.kv_chunk, &list.pattern_id}) v->reserve(visited);
    for (auto* v : {&list.kind, &list.split}) v->reserve(visited);
    for (auto* v : {&list.first, &list.last}) v->reserve(visited);
    const int64_t n_outer = q_outer ? plan.nq : plan.nkv;
    const int64_t n_inner = q_outer ? plan.nkv : plan.nq;
    for (int64_t o = 0; o < n_outer; ++o) {
        const size_t start = list.kind.size();
        for (int64_t x = 0; x < n_inner; ++x) {
            const int64_t bi = q_outer ? o : x;
            const int64_t bj = q_outer ? x : o;
            const auto flat = static_cast<size_t>(bi * plan.nkv + bj);
            if (plan.kind[flat] == static_cast<int8_t>(BlockKind::Skip)) continue;
            list.q_chunk.push_back(static_cast<int32_t>(bi));
            list.kv_chunk.push_back(static_cast<int32_t>(bj));
            list.kind.push_back(plan.kind[flat]);
            list.pattern_id.push_back(plan.pattern_id[flat]);
            list.split.push_back(plan.split[flat]);
            list.first.push_back(list.kind.size() == start + 1 ? 1 : 0);
            list.last.push_back(0);
        }
        if (list.kind.size() > start) list.last.back() = 1;
    }
    return list;
}

// sum_{x = a}^{a + m - 1} clamp(x, 0, n), closed form (m >= 0, n >= 0).
int64_t sumClamped(int64_t a, int64_t m, int64_t n) {
    const int64_t b = a + m - 1;
    int64_t total = 0;
    const int64_t p = std::max<int64_t>(a, 1), q = std::min(b, n);  // x itself
    if (p <= q) total += (p + q) * (q - p + 1) / 2;
    const int64_t r = std::max(a, n + 1);  // clamped to n
    if (r <= b) total += n * (b - r + 1);
    return total;
}

// Cells (i, j) of the Lq x Lkv matrix with j - i <= t: row i holds clamp(i + t + 1, 0, Lkv).
int64_t cellsOnOrBelow(const PlanRequest& req, int64_t t) {
    return sumClamped(t + 1, req.lq, req.lkv);
}

// Closed form: row i sees [max(0, i + shift + low), min(Lkv - 1, i + shift + high)], and
// low <= 0 <= high whenever both are bounded (a window side is >= 0, causal is high = 0), so a
// row sees nothing iff i + shift + high < 0 (a leading row) or i + shift + low > Lkv - 1 (a
// trailing one); the visible cells are those with low <= j - i - shift <= high.
void fillRowCounts(const PlanRequest& req, BlockPlan& plan) {
    const DiagonalBand band = bandOf(req);
    const int64_t shift = req.lkv - req.lq;
    plan.empty_rows_before =
        band.has_high ? std::clamp<int64_t>(-shift - band.high, 0, req.lq) : 0;
    plan.empty_rows_from =
        band.has_low ? std::clamp<int64_t>(req.lkv - shift - band.low, plan.empty_rows_before,
                                           req.lq)
                     : req.lq;
    const int64_t upper =
        band.has_high ? cellsOnOrBelow(req, shift + band.high) : req.lq * req.lkv;
    const int64_t lower = band.has_low ? cellsOnOrBelow(req, shift + band.low - 1) : 0;
    plan.visible_elements = upper - lower;
}

}  // namespace

BlockPlan planBlocks(const PlanRequest& req) {
    validate(req);
    BlockPlan plan;
    plan.nq = ceilDiv(req.lq, req.chunk_q);
    plan.nkv = ceilDiv(req.lkv, req.chunk_kv);
    if (req.lq > kInt32Max || plan.nq > kInt32Max || plan.nkv > kInt32Max ||
        plan.nq * plan.nkv > kInt32Max) {
        throw std::length_error("the block grid " + std::to_string(plan.nq) + "x" +
                                std::to_string(plan.nkv) + " for Lq=" + std::to_string(req.lq) +
                                " does not fit the int32 schedule tables");
    }
    fillBlockTables(req, plan);
    fillRowCounts(req, plan);
    plan.q_major = flatten(plan, true);
    plan.kv_major = flatten(plan, false);
    return plan;
}

}  // namespace popxl_flash
