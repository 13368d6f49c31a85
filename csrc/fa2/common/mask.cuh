// Masking for the seqlen tail, causal (window_right = 0) and sliding windows, bottom-right
// aligned as flash-attn >= 2.1: key col is visible to query row when col < sk and
// row + off - left <= col <= row + off + right (off = sk - sq; a bound of -1 is unbounded).
//
// Written so that sharing them costs nothing (csrc/fa2/MEASUREMENTS.md has the SASS counts):
// - key_visible takes the window bounds as values the caller read once per tile. Reading
//   p.window_* inside the && chain made those loads conditional, so the chain stayed as
//   branches instead of predicated selects: 269 BRA instead of 109 at sm75 d=64. The
//   bitwise form (& and | on the bools) has no branches but computes the bools as
//   integers: 243 -> 255 registers at sm70 d=96 and d=128.
// - The tile test is a macro, not a function: every function form tried (bool or int
//   result, short-circuit, bitwise or negated) added 2 to 12 SASS instructions in some
//   kernels (its result materialized with SEL and tested again), or a register when its
//   bounds stayed live across the key loop. As an expression in the kernel's own
//   condition it compiles to the predicates and the one branch it had inline.
#pragma once

#include "fa2.h"

// Whether key tile [n0, n0 + BC) holds a key that one of rows [m0, last_row] must not
// see: past the keys, past the right bound of the first row or before the left bound of
// the last row. Uniform per CTA and tile: most tiles skip the per-element test.
#define SM7X_FA2_TILE_NEEDS_MASK(p, BC, n0, m0, last_row, sk, off)                   \
  ((n0) + (BC) > (sk) ||                                                           \
   ((p).window_right >= 0 && (n0) + (BC) - 1 > (m0) + (off) + (p).window_right) || \
   ((p).window_left >= 0 && (n0) < (last_row) + (off) - (p).window_left))

namespace sm7x {
namespace fa2 {
namespace detail {

// Whether key col is visible to query row; left and right are p.window_left/right, read
// by the caller before its loop over the scores (see above).
__device__ __forceinline__ bool key_visible(int col, int row, int sk, int off, int left,
                                            int right) {
  return col < sk && (right < 0 || col <= row + off + right) &&
         (left < 0 || col >= row + off - left);
}

}  // namespace detail
}  // namespace fa2
}  // namespace sm7x
