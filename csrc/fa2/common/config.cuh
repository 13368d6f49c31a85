// What both architectures' kernel configs share: the tile shape and the K/V prefetch
// schedules. Each arch's FwdConfig (sm75/fwd_kernel.cuh, sm70/fwd_kernel.cuh) derives from
// FwdShape and adds its own shared-memory layout; the values come from
// python/sm7x/targets.json through the generated instantiation files.
#pragma once

namespace sm7x {
namespace fa2 {

// How the next K/V tiles travel global -> registers -> shared memory (there is no
// cp.async before sm_80):
//   kNone:   fetched after the GEMMs of the current tile, once every warp is done with it
//            (no staging registers live across the GEMMs; sm70, head dims whose
//            accumulators leave no registers to spare).
//   kBoth:   K_{t+1} and V_{t+1} are both fetched into registers at the top of iteration t
//            and stored after O += P V_t (2 barriers per tile, two tiles of staging
//            registers).
//   kStaged: K_{t+1} is fetched during S = Q K_t^T and the softmax and stored once every
//            warp is done with K_t; V_{t+1} is then fetched during P V_t and stored once
//            every warp is done with V_t (sm75: 2 barriers per tile, one tile of staging
//            registers).
//   kDouble: as kBoth, but K/V are double-buffered in shared memory: tile t+1 is stored
//            into the buffer tile t-1 used, which every warp left before the last
//            barrier, so one barrier per tile suffices (sm75; twice the K/V smem).
enum class KvPrefetch { kNone, kBoth, kStaged, kDouble };

// A CTA computes BR query rows of one (batch, head) with BR / WR warps of WR rows each
// (WR / 16 m16 slices per warp: with 32 rows, every K/V fragment a warp loads from shared
// memory feeds two MMAs instead of one), walking K/V in tiles of BC keys. KS > 1 (sm75
// only, "dim_split" 2 or 4): KS warps share each WR rows, each owning D / KS columns of Q and O
// (BR / WR x KS warps). Tiles are fp16
// [rows][D + 8] in shared memory: the 16-byte row padding puts the 8 row addresses of a
// matrix load in distinct banks.
template <int D, int BR, int BC, int WR = 16, int KS = 1>
struct FwdShape {
  static constexpr int kHeadDim = D;
  static constexpr int kBlockM = BR;
  static constexpr int kBlockN = BC;
  static constexpr int kWarpRows = WR;
  static constexpr int kSlices = WR / 16;  // m16 slices per warp
  static constexpr int kDimSplit = KS;
  static constexpr int kWarps = BR / WR * KS;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kStride = D + 8;  // fp16 tile row stride (halves)
  static constexpr int kChunks = D / 8;  // 16-byte chunks per row
  // uint4 per thread of a Q / K-V tile copy (the last round partial where the chunks do
  // not split evenly over the threads: in_tile, common/tile_io.cuh)
  static constexpr int kQLoads = (BR * kChunks + kThreads - 1) / kThreads;
  static constexpr int kTileLoads = (BC * kChunks + kThreads - 1) / kThreads;
  static_assert(D % 16 == 0 && D <= 512, "head dim: a multiple of 16, at most 512");
  static_assert(BR % 16 == 0 && BC % 16 == 0, "tiles: multiples of 16");
  static_assert((WR == 16 || WR == 32) && BR % WR == 0, "warp rows: 16 or 32, dividing BR");
  static_assert((KS == 1 || KS == 2 || KS == 4) && D % (16 * KS) == 0,
                "dim split: 1, 2 or 4 warps per row slice, each a multiple of 16 columns");
};

}  // namespace fa2
}  // namespace sm7x
