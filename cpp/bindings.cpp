// pybind11 face of the block planner: popxl_flash._planner.plan_blocks(...) -> dict.
//
// Private module; popxl_flash/schedule.py validates the arguments and wraps the result in a
// BlockSchedule. Arrays are handed to numpy without copying: each std::vector is moved to the
// heap and owned by a capsule that frees it when the array dies.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <utility>
#include <vector>

#include "planner.hpp"

namespace py = pybind11;

namespace {

// Moves `values` into a numpy array of `dtype` and `shape` (C order) owned by a capsule.
template <typename T>
py::array toArray(std::vector<T>&& values, const py::dtype& dtype,
                  std::vector<py::ssize_t> shape) {
    auto* owned = new std::vector<T>(std::move(values));
    py::capsule owner(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
    return py::array(dtype, std::move(shape), {}, owned->data(), owner);
}

// The flat block list of one loop nest as a dict of 1-D arrays.
py::dict listToDict(popxl_flash::BlockList&& list) {
    const auto n = static_cast<py::ssize_t>(list.kind.size());
    py::dict out;
    out["q_chunk"] = toArray(std::move(list.q_chunk), py::dtype::of<int32_t>(), {n});
    out["kv_chunk"] = toArray(std::move(list.kv_chunk), py::dtype::of<int32_t>(), {n});
    out["kind"] = toArray(std::move(list.kind), py::dtype::of<int8_t>(), {n});
    out["pattern_id"] = toArray(std::move(list.pattern_id), py::dtype::of<int32_t>(), {n});
    out["split"] = toArray(std::move(list.split), py::dtype::of<int8_t>(), {n});
    out["first"] = toArray(std::move(list.first), py::dtype("bool"), {n});
    out["last"] = toArray(std::move(list.last), py::dtype("bool"), {n});
    return out;
}

py::dict planBlocksPy(int64_t lq, int64_t lkv, int64_t chunk_q, int64_t chunk_kv, bool causal,
                      int64_t window_left, int64_t window_right) {
    const popxl_flash::PlanRequest request{lq, lkv, chunk_q, chunk_kv,
                                           causal, window_left, window_right};
    popxl_flash::BlockPlan plan;
    {
        py::gil_scoped_release release;
        plan = popxl_flash::planBlocks(request);
    }
    const auto nq = static_cast<py::ssize_t>(plan.nq);
    const auto nkv = static_cast<py::ssize_t>(plan.nkv);

    py::dict out;
    out["nq"] = plan.nq;
    out["nkv"] = plan.nkv;
    out["kind"] = toArray(std::move(plan.kind), py::dtype::of<int8_t>(), {nq, nkv});
    out["pattern_id"] = toArray(std::move(plan.pattern_id), py::dtype::of<int32_t>(), {nq, nkv});
    out["pattern_keys"] = toArray(std::move(plan.pattern_keys), py::dtype::of<int64_t>(),
                                  {static_cast<py::ssize_t>(plan.num_patterns), 4});
    out["split"] = toArray(std::move(plan.split), py::dtype::of<int8_t>(), {nq, nkv});
    out["visited_per_q"] = toArray(std::move(plan.visited_per_q), py::dtype::of<int32_t>(), {nq});
    out["empty_rows_before"] = plan.empty_rows_before;
    out["empty_rows_from"] = plan.empty_rows_from;
    out["visible_elements"] = plan.visible_elements;
    out["visited_blocks"] = plan.visited_blocks;
    out["full_blocks"] = plan.full_blocks;
    out["partial_blocks"] = plan.partial_blocks;
    out["executed_elements"] = plan.executed_elements;
    out["q_major"] = listToDict(std::move(plan.q_major));
    out["kv_major"] = listToDict(std::move(plan.kv_major));
    return out;
}

}  // namespace

PYBIND11_MODULE(_planner, m) {
    m.doc() = "Compiled block planner of popxl_flash (private; use popxl_flash.schedule.plan).";
    m.attr("UNBOUNDED") = popxl_flash::kUnbounded;
    m.def("plan_blocks", &planBlocksPy, py::arg("lq"), py::arg("lkv"), py::arg("chunk_q"),
          py::arg("chunk_kv"), py::arg("causal"), py::arg("window_left"),
          py::arg("window_right"),
          "Plan the block schedule in O(blocks); returns a dict of numpy arrays and int counts "
          "(pattern keys, not pattern cells). "
          "Raises ValueError on invalid arguments.");
}
