// Launcher of the row-gather kernel (kernels/embedding.cu): embedding lookup, and picking the rows
// that need logits. Conventions: kernels/kernel_common.h.
#pragma once

#include <cstdint>

#include "kernel_common.h"

namespace kvflow::cuda {

// dst[i, :] = float(src[indices[i], :]) * scale for i < num_rows; rows of n elements, src rows
// src_row_stride apart, dst dense; `scale` is Gemma's embedding scale sqrt(hidden) (fp32, as
// ModelConfig::embedding_scale), 1 elsewhere. An index outside [0, num_src_rows) writes a row of NaN
// (the host validates token ids, so this only makes a bug loud).
// shard_first >= 0: src is rows [shard_first, shard_first + num_src_rows) of a larger table (a rank's
// vocabulary shard under tensor parallelism): index i reads row i - shard_first, and an index outside
// the shard writes a row of zeros (another rank's token; the ranks' rows are then summed).
int GatherRowsToF32(DType src_dtype, const void* src, int64_t src_row_stride, int64_t num_src_rows,
                    const int32_t* indices, int num_rows, int n, float* dst, void* stream, float scale = 1.0f,
                    int64_t shard_first = -1);

}  // namespace kvflow::cuda
