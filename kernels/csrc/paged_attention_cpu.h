// What the paged-attention kernels share: one call's problem (query rows,
// the paged cache, the tables) and the walk over a sequence's cache rows.
#pragma once

#include <cstdint>

namespace fleet_attention {

template <typename T>
struct Problem {
  const T* query;            // [R, H, D], rows and heads strided, D contiguous
  int64_t query_row_stride, query_head_stride;
  const T* keys;             // kv_cache[0]: [num_blocks, block_size, KVH, D] contiguous
  const T* values;           // kv_cache[1]
  const int32_t* block_tables;  // [S, W], rows strided
  int64_t table_stride;
  const int32_t* seq_index;  // [R]: table row of each query row; null = row r uses table row r
  const int32_t* kv_lens;    // [R]: keys each row attends to
  T* out;                    // [R, H, D] contiguous
  int64_t num_kv_heads, group, head_dim, block_size;
  float scale;
  int64_t window;            // > 0: a row attends to its last `window` keys only (sliding window); 0: all
};

// Walks a sequence's tokens in order: element offset of each one's row (at a
// given head) in the keys or the values of the cache.
struct TokenCursor {
  const int32_t* table;
  int64_t block_size, token_stride, head_offset;
  int64_t block_idx = 0, slot = 0;

  int64_t next() {
    const int64_t offset = (table[block_idx] * block_size + slot) * token_stride + head_offset;
    if (++slot == block_size) {
      slot = 0;
      ++block_idx;
    }
    return offset;
  }

  // The next n tokens' rows in the keys and in the values of the cache.
  template <typename T>
  void next_rows(int64_t n, const T* keys, const T* values, const T** key_rows, const T** value_rows) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t offset = next();
      key_rows[j] = keys + offset;
      value_rows[j] = values + offset;
    }
  }
};

}  // namespace fleet_attention
