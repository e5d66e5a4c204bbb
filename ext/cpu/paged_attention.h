// aiolm::paged_attention's work (paged_attention.cpp) for a team of threads that runs a
// whole decode step in one parallel region (decode_layer.cpp): each of the team's threads
// calls share with the same arguments and takes work units from the team's counter, which
// must be 0 when the first thread starts. The units and their results are the op's own.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>

namespace aiolm_attention {

void share(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
           const at::Tensor& block_table, const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
           int64_t window, double softcap, std::atomic<int64_t>& next, int64_t threads);

}  // namespace aiolm_attention
