// qtorch-onnx ONNX Runtime operator library: tensor-level drivers (block layout, threading).
//
// Independent of ONNX Runtime: the drivers split a tensor into independent tasks and hand them to a
// TaskRunner (the ONNX Runtime kernels pass one backed by the session's intra-op thread pool). Every task
// covers whole blocks (block formats) or a range of elements (Q/DQ) and writes only its own output
// elements, so the result is identical for any number of threads and any task order.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "numerics.h"

// AVX2 and baseline versions of the element-wise loops, picked when the library is loaded (GCC on x86-64
// Linux; same IEEE float32 operations in both, no FMA contraction: -ffp-contract=off).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    !defined(QTORCH_ORT_NO_MULTIVERSION)
#define QTORCH_ORT_TEMPLATE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define QTORCH_ORT_TEMPLATE_CLONES
#endif

#if defined(__SSE__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 1)
#include <xmmintrin.h>
#define QTORCH_ORT_HAVE_MXCSR 1
#endif

namespace qtorch_ort {

// Tensors with fewer elements than this run on the calling thread only.
constexpr int64_t kParallelMinElements = 1 << 16;
// Elements per task when a tensor is split (large enough to amortise scheduling, small enough to balance).
constexpr int64_t kTaskElements = 1 << 15;
// Elements in the gather buffer of one tile when blocks are strided (block axis not the last one).
constexpr int64_t kTileElements = 1 << 13;

// Clears flush-to-zero and denormals-are-zero for the lifetime of the object and restores the caller's
// state afterwards: the numerics contract keeps float32 subnormals (docs/numerics.md sections 4-7), whatever
// the session's "set_denormal_as_zero" option or another library set on the worker thread.
class DenormalGuard {
 public:
#ifdef QTORCH_ORT_HAVE_MXCSR
  DenormalGuard() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~0x8040u); }
  ~DenormalGuard() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#else
  DenormalGuard() = default;
#endif
};

// Runs fn(data, t) for t in [0, n_tasks), possibly concurrently, and returns when all are done.
class TaskRunner {
 public:
  using TaskFn = void (*)(void* data, size_t task);
  virtual ~TaskRunner() = default;
  virtual void Run(size_t n_tasks, TaskFn fn, void* data) const = 0;
};

// The plain sequential runner (and what small tensors use).
class SerialRunner final : public TaskRunner {
 public:
  void Run(size_t n_tasks, TaskFn fn, void* data) const override {
    for (size_t t = 0; t < n_tasks; ++t) fn(data, t);
  }
};

// Element access: float32 is read as is, float16 (stored as uint16_t bits) is widened exactly and narrowed
// back with round to nearest even (docs/numerics.md section 4: float16 is computed through float32).
inline float load_elem(const float* p, int64_t i) { return p[i]; }
inline float load_elem(const uint16_t* p, int64_t i) { return half_to_float(p[i]); }
inline void store_elem(float* p, int64_t i, float v) { p[i] = v; }
inline void store_elem(uint16_t* p, int64_t i, float v) { p[i] = float_to_half(v); }

// Layout of a tensor seen as [outer, L, inner] around the block axis (docs/numerics.md section 4): a block is
// block_size consecutive indices along L with the outer and inner indices fixed.
struct BlockLayout {
  int64_t outer = 1;
  int64_t length = 1;  // L, the block axis
  int64_t inner = 1;
  int64_t block_size = 1;
};

// BlockFn: callable as fn(const float* in, float* out, int64_t n, int64_t count) on `count` consecutive
// contiguous blocks of n elements each (in + j * n).
template <typename T, typename BlockFn>
class BlockJob {
 public:
  BlockJob(const T* x, T* y, const BlockLayout& lay, const BlockFn& fn) : x_(x), y_(y), lay_(lay), fn_(fn) {
    n_blocks_ = (lay.length + lay.block_size - 1) / lay.block_size;
    full_blocks_ = lay.length / lay.block_size;
    rows_ = std::min(lay.block_size, lay.length);
    if (lay.inner == 1) {
      cols_ = 1;
      col_chunks_ = 1;
    } else {
      cols_ = std::max<int64_t>(1, std::min<int64_t>(lay.inner, kTileElements / rows_));
      col_chunks_ = (lay.inner + cols_ - 1) / cols_;
    }
    units_ = lay.outer * n_blocks_ * col_chunks_;
    const int64_t unit_elems = rows_ * cols_;
    units_per_task_ = std::max<int64_t>(1, kTaskElements / unit_elems);
    n_tasks_ = (units_ + units_per_task_ - 1) / units_per_task_;
  }

  size_t n_tasks() const { return static_cast<size_t>(n_tasks_); }
  bool failed() const { return failed_.load(); }

  static void Task(void* self, size_t task) {
    auto* job = static_cast<BlockJob*>(self);
    try {
      DenormalGuard guard;
      job->RunTask(static_cast<int64_t>(task));
    } catch (...) {  // std::bad_alloc from a tile buffer: reported by the kernel, never thrown into ORT
      job->failed_.store(true);
    }
  }

 private:
  // Blocks [u0, u1) of rows laid out contiguously (inner == 1): consecutive full blocks of a row go to the
  // block function in one call; float16 is widened into a buffer and narrowed back.
  void RunRows(int64_t u0, int64_t u1) {
    const BlockLayout& L = lay_;
    constexpr bool kDirect = std::is_same<T, float>::value;
    std::vector<float> bin, bout;
    if (!kDirect) {
      const size_t cap = static_cast<size_t>(std::min(units_per_task_, n_blocks_) * rows_);
      bin.resize(cap);
      bout.resize(cap);
    }
    int64_t b = u0 % n_blocks_;                                     // block index within the row
    int64_t off = (u0 / n_blocks_) * L.length + b * L.block_size;   // element offset of the block
    int64_t u = u0;
    while (u < u1) {
      int64_t n, count;
      if (b < full_blocks_) {
        n = L.block_size;
        count = std::min(full_blocks_ - b, u1 - u);
      } else {  // the partial last block of the row
        n = L.length - b * L.block_size;
        count = 1;
      }
      if constexpr (kDirect) {
        fn_(reinterpret_cast<const float*>(x_) + off, reinterpret_cast<float*>(y_) + off, n, count);
      } else {
        const int64_t m = n * count;
        for (int64_t i = 0; i < m; ++i) bin[i] = load_elem(x_, off + i);
        fn_(bin.data(), bout.data(), n, count);
        for (int64_t i = 0; i < m; ++i) store_elem(y_, off + i, bout[i]);
      }
      off += n * count;
      u += count;
      b += count;
      if (b == n_blocks_) b = 0;
    }
  }

  void RunTask(int64_t task) {
    const int64_t u0 = task * units_per_task_;
    const int64_t u1 = std::min(units_, u0 + units_per_task_);
    const BlockLayout& L = lay_;
    if (L.inner == 1) return RunRows(u0, u1);
    // Strided blocks: gather a tile of (rows x cols) into column-major buffers so that every block is
    // contiguous, run the block function on the cols blocks at once, scatter back. Reads and writes stay
    // row-contiguous.
    std::vector<float> bin(static_cast<size_t>(rows_ * cols_)), bout(static_cast<size_t>(rows_ * cols_));
    const int64_t per_outer = n_blocks_ * col_chunks_;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t o = u / per_outer, rest = u % per_outer;
      const int64_t b = rest / col_chunks_, cc = rest % col_chunks_;
      const int64_t l0 = b * L.block_size;
      const int64_t rows = std::min(L.block_size, L.length - l0);
      const int64_t i0 = cc * cols_;
      const int64_t nc = std::min(cols_, L.inner - i0);
      const int64_t base = (o * L.length + l0) * L.inner + i0;
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t src = base + r * L.inner;
        for (int64_t c = 0; c < nc; ++c) bin[c * rows + r] = load_elem(x_, src + c);
      }
      fn_(bin.data(), bout.data(), rows, nc);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t dst = base + r * L.inner;
        for (int64_t c = 0; c < nc; ++c) store_elem(y_, dst + c, bout[c * rows + r]);
      }
    }
  }

  const T* x_;
  T* y_;
  BlockLayout lay_;
  BlockFn fn_;
  int64_t n_blocks_ = 0, full_blocks_ = 0, rows_ = 0, cols_ = 0, col_chunks_ = 0, units_ = 0, units_per_task_ = 1,
          n_tasks_ = 0;
  std::atomic<bool> failed_{false};
};

// Runs a block function over a whole tensor. Returns false if a task failed (out of memory).
template <typename T, typename BlockFn>
bool RunBlocks(const T* x, T* y, const BlockLayout& lay, const BlockFn& fn, const TaskRunner& runner) {
  BlockJob<T, BlockFn> job(x, y, lay, fn);
  const int64_t numel = lay.outer * lay.length * lay.inner;
  if (numel < kParallelMinElements || job.n_tasks() <= 1) {
    SerialRunner().Run(job.n_tasks(), &BlockJob<T, BlockFn>::Task, &job);
  } else {
    runner.Run(job.n_tasks(), &BlockJob<T, BlockFn>::Task, &job);
  }
  return !job.failed();
}

// Element-wise map with an optional channel index: y[i] = fn.at(c)(x[i]) where c = (i / inner) % channels
// (channels = 1 for per-tensor parameters). ElemFn::at(channel) returns a callable In -> Out that holds the
// channel's parameters by value (so that stores to y, which may alias them as far as the compiler knows,
// do not force reloads inside the vectorized loop).
template <typename In, typename Out, typename ElemFn>
class ElementwiseJob {
 public:
  ElementwiseJob(const In* x, Out* y, int64_t n, int64_t channels, int64_t inner, const ElemFn& fn)
      : x_(x), y_(y), n_(n), channels_(channels), inner_(inner), fn_(fn) {
    per_task_ = kTaskElements * 2;
    n_tasks_ = (n_ + per_task_ - 1) / per_task_;
  }
  size_t n_tasks() const { return static_cast<size_t>(n_tasks_); }

  static void Task(void* self, size_t task) {
    auto* job = static_cast<ElementwiseJob*>(self);
    DenormalGuard guard;
    job->RunTask(static_cast<int64_t>(task));
  }

 private:
  QTORCH_ORT_TEMPLATE_CLONES void RunTask(int64_t task) {
    const int64_t i0 = task * per_task_;
    const int64_t i1 = std::min(n_, i0 + per_task_);
    // local copies: a store through an int8/uint8 pointer may alias the members as far as the compiler
    // knows, which would force a reload per element and block vectorization
    const In* const x = x_;
    Out* const y = y_;
    if (channels_ <= 1) {
      const auto op = fn_.at(0);
      for (int64_t i = i0; i < i1; ++i) y[i] = op(x[i]);
      return;
    }
    // runs of `inner` consecutive elements share one channel: loop over the runs, vectorize inside them
    int64_t i = i0;
    while (i < i1) {
      const int64_t run = i / inner_;
      const int64_t c = run % channels_;
      const int64_t end = std::min(i1, (run + 1) * inner_);
      const auto op = fn_.at(c);
      for (int64_t j = i; j < end; ++j) y[j] = op(x[j]);
      i = end;
    }
  }

  const In* x_;
  Out* y_;
  int64_t n_, channels_, inner_;
  ElemFn fn_;
  int64_t per_task_ = 1, n_tasks_ = 0;
};

template <typename In, typename Out, typename ElemFn>
void RunElementwise(const In* x, Out* y, int64_t n, int64_t channels, int64_t inner, const ElemFn& fn,
                    const TaskRunner& runner) {
  ElementwiseJob<In, Out, ElemFn> job(x, y, n, channels, inner, fn);
  if (n < kParallelMinElements || job.n_tasks() <= 1) {
    SerialRunner().Run(job.n_tasks(), &ElementwiseJob<In, Out, ElemFn>::Task, &job);
  } else {
    runner.Run(job.n_tasks(), &ElementwiseJob<In, Out, ElemFn>::Task, &job);
  }
}

}  // namespace qtorch_ort
