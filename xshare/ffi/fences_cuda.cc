// xshare XLA FFI fences, CUDA handlers (registered with platform="CUDA").
//
// Host-only code (no kernels): builds with g++ (or nvcc) against the CUDA
// headers and links cudart. Linked against libxshare_fences.so, which owns the
// rings, the lane table, the clock and the validation, so CPU and CUDA fences
// share them.
//
// STATUS: compiled by the test suite (g++ against the CUDA headers, and
// nvcc 13 with -x cu), but it has NOT yet run on a GPU: no GPU was available
// when it was written. tests/ffi/test_cuda_device.py exercises it on one
// (JAX_PLATFORMS=cuda,cpu) and skips elsewhere; trust its timestamps only once
// that test has passed on your hardware.
//
// Why events, not host callbacks: on CUDA the handler runs on the host when XLA
// *enqueues* the fence, not when the GPU reaches it. A timestamp taken by
// cudaLaunchHostFunc would be right, but every host function stalls the
// stream until a driver thread has run it. So each fence records a cudaEvent on
// the stream XLA hands us and returns; the events are read back later, off the
// dispatch path, when Python drains a ring (xshare_cuda_poll):
//
//   t_ns(event) = anchor.t_ns + cudaEventElapsedTime(anchor.ev, event)
//
// where the anchor is an event recorded on an idle stream of our own and waited
// for, with the host clock read around it, so its completion time on the
// fences' clock (steady_clock) is known to within a few microseconds.
//
// The identity operand (ident, int32[..., 3]) is in device memory. Each fence
// copies its 12 bytes per row with cudaMemcpyAsync into a pinned host slot that
// belongs to the fence's event; the slot is read once a second event, recorded
// after that copy, has completed. Per fence on the stream: one timing event, a
// 12-byte device-to-host copy, one completion event; no synchronization.

#include <cuda_runtime_api.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// From libxshare_fences.so (fences.cc).
namespace xshare {
ffi::Error ValidateFence(int32_t kind, const ffi::RemainingArgs& args,
                         const ffi::RemainingRets& rets,
                         std::vector<ffi::AnyBuffer>* ins,
                         std::vector<ffi::Result<ffi::AnyBuffer>>* outs,
                         std::optional<ffi::AnyBuffer>* ident);
const char* FenceName(int32_t kind);
int64_t NowNs();
}  // namespace xshare
extern "C" int32_t xshare_record_rows(const int32_t* rows, int64_t n_rows,
                                      int32_t kind, int64_t t_ns);

namespace xshare {
namespace {

constexpr size_t kMaxRows = 64;     // ident rows per fence (a fused group)
constexpr size_t kChunk = 256;      // slots per pinned-memory allocation
constexpr size_t kMaxSlots = 1 << 16;  // pending fences per device; beyond
                                       // that (nobody drains) records are lost
constexpr int64_t kReanchorNs = 1000000000;  // float ms keeps ~60 ns at 1 s

std::atomic<int64_t> g_lost{0};  // records lost: pool full, ring closed, error

// A device event whose completion time on the fences' clock is known.
struct Anchor {
  cudaEvent_t ev = nullptr;
  int64_t t_ns = 0;
  ~Anchor() {
    if (ev) cudaEventDestroy(ev);
  }
};

struct Slot {
  cudaEvent_t timed = nullptr;  // the fence's timestamp
  cudaEvent_t done = nullptr;   // after the ident copy: the slot is readable
  int32_t* rows = nullptr;      // pinned host memory, kMaxRows * 3
  size_t n_rows = 0;
  int32_t kind = 0;
  std::shared_ptr<Anchor> anchor;  // the anchor current when enqueued
};

// Everything for one device. Never destroyed: handlers and polls may run
// during interpreter shutdown.
class DevicePool {
 public:
  explicit DevicePool(int device) : device_(device) {}

  // A free slot, or nullptr when kMaxSlots are pending (records then lost).
  // Called on XLA's dispatch thread with the device current.
  cudaError_t Acquire(Slot** out) {
    std::lock_guard<std::mutex> lock(mu_);
    *out = nullptr;
    if (!anchor_) {
      // Once per device and process: the first fence waits for one event on
      // our own idle stream (tens of microseconds).
      cudaError_t err = NewAnchorLocked();
      if (err != cudaSuccess) return err;
    }
    if (free_.empty() && n_slots_ < kMaxSlots) {
      cudaError_t err = GrowLocked();
      if (err != cudaSuccess) return err;
    }
    if (free_.empty()) return cudaSuccess;
    *out = free_.back();
    free_.pop_back();
    (*out)->anchor = anchor_;
    return cudaSuccess;
  }

  void Release(Slot* s) {
    std::lock_guard<std::mutex> lock(mu_);
    s->anchor.reset();
    free_.push_back(s);
  }

  void Enqueue(cudaStream_t stream, Slot* s) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_[stream].push_back(s);
  }

  // Turns completed fences into records, oldest first per stream. Returns how
  // many fences completed. Never blocks on the device.
  int64_t Poll() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (auto& [stream, queue] : pending_) {
      while (!queue.empty()) {
        Slot* s = queue.front();
        cudaError_t q = cudaEventQuery(s->done);
        if (q == cudaErrorNotReady) break;
        float ms = 0.f;
        if (q == cudaSuccess) q = cudaEventElapsedTime(&ms, s->anchor->ev, s->timed);
        if (q == cudaSuccess) {
          const int64_t t =
              s->anchor->t_ns + static_cast<int64_t>(std::llround(ms * 1e6));
          if (xshare_record_rows(s->rows, static_cast<int64_t>(s->n_rows),
                                 s->kind, t) != 0)
            g_lost.fetch_add(1);
        } else {
          // A failed stream never completes its events normally; the record
          // is lost but the slot is reusable once the error is reported.
          g_lost.fetch_add(1);
        }
        queue.pop_front();
        s->anchor.reset();
        free_.push_back(s);
        ++n;
      }
    }
    if (anchor_ && NowNs() - anchor_->t_ns > kReanchorNs) {
      int prev = -1;
      cudaGetDevice(&prev);
      if (cudaSetDevice(device_) == cudaSuccess) NewAnchorLocked();
      if (prev >= 0) cudaSetDevice(prev);
    }
    return n;
  }

  int64_t Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = 0;
    for (auto& kv : pending_) n += static_cast<int64_t>(kv.second.size());
    return n;
  }

 private:
  cudaError_t GrowLocked() {
    int32_t* pinned = nullptr;
    cudaError_t err = cudaHostAlloc(reinterpret_cast<void**>(&pinned),
                                    kChunk * kMaxRows * 3 * sizeof(int32_t),
                                    cudaHostAllocDefault);
    if (err != cudaSuccess) return err;
    std::unique_ptr<Slot[]> chunk(new Slot[kChunk]);
    for (size_t i = 0; i < kChunk; ++i) {
      Slot& s = chunk[i];
      s.rows = pinned + i * kMaxRows * 3;
      err = cudaEventCreate(&s.timed);
      if (err == cudaSuccess)
        err = cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming);
      if (err != cudaSuccess) return err;  // leaks a chunk once; never retried
    }
    for (size_t i = 0; i < kChunk; ++i) free_.push_back(&chunk[i]);
    chunks_.push_back(std::move(chunk));
    n_slots_ += kChunk;
    return cudaSuccess;
  }

  // Records an event on our own idle stream and waits for it. The host clock
  // is read just before the record and just after the wait; the event
  // completed in between. The narrowest of three tries is kept.
  cudaError_t NewAnchorLocked() {
    cudaError_t err = cudaSuccess;
    if (!anchor_stream_) {
      err = cudaStreamCreateWithFlags(&anchor_stream_, cudaStreamNonBlocking);
      if (err != cudaSuccess) return err;
    }
    std::shared_ptr<Anchor> best;
    int64_t best_width = INT64_MAX;
    for (int i = 0; i < 3; ++i) {
      auto a = std::make_shared<Anchor>();
      err = cudaEventCreate(&a->ev);
      if (err != cudaSuccess) return err;
      const int64_t t0 = NowNs();
      err = cudaEventRecord(a->ev, anchor_stream_);
      if (err == cudaSuccess) err = cudaEventSynchronize(a->ev);
      const int64_t t1 = NowNs();
      if (err != cudaSuccess) return err;
      a->t_ns = t0 + (t1 - t0) / 2;
      if (t1 - t0 < best_width) {
        best_width = t1 - t0;
        best = a;
      }
    }
    anchor_ = best;
    return cudaSuccess;
  }

  const int device_;
  std::mutex mu_;
  std::vector<Slot*> free_;
  std::map<cudaStream_t, std::deque<Slot*>> pending_;
  std::vector<std::unique_ptr<Slot[]>> chunks_;
  size_t n_slots_ = 0;
  std::shared_ptr<Anchor> anchor_;
  cudaStream_t anchor_stream_ = nullptr;
};

std::mutex g_pools_mu;
std::map<int, DevicePool*>& Pools() {
  static auto* pools = new std::map<int, DevicePool*>();  // never destroyed
  return *pools;
}

DevicePool* PoolFor(int device) {
  std::lock_guard<std::mutex> lock(g_pools_mu);
  auto& pools = Pools();
  auto it = pools.find(device);
  if (it != pools.end()) return it->second;
  auto* p = new DevicePool(device);
  pools.emplace(device, p);
  return p;
}

ffi::Error CudaError(int32_t kind, const char* what, cudaError_t err) {
  std::ostringstream os;
  os << FenceName(kind) << ": " << what << " failed: " << cudaGetErrorName(err)
     << " (" << cudaGetErrorString(err) << ")";
  return ffi::Error::Internal(os.str());
}

// Enqueues the fence's timestamp and the ident read-back on `stream`.
ffi::Error Stamp(int32_t kind, cudaStream_t stream,
                 const ffi::AnyBuffer& ident) {
  const size_t n_rows = ident.element_count() / 3;
  if (n_rows > kMaxRows) {
    std::ostringstream os;
    os << FenceName(kind) << ": the ident has " << n_rows
       << " rows; the CUDA fences take at most " << kMaxRows
       << " (members of one fused step)";
    return ffi::Error::InvalidArgument(os.str());
  }
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return CudaError(kind, "cudaGetDevice", err);
  DevicePool* pool = PoolFor(device);
  Slot* s = nullptr;
  err = pool->Acquire(&s);
  if (err != cudaSuccess) return CudaError(kind, "creating the fence events", err);
  if (s == nullptr) {  // kMaxSlots fences pending: nobody drains the rings
    g_lost.fetch_add(1);
    return ffi::Error::Success();
  }
  s->kind = kind;
  s->n_rows = n_rows;
  err = cudaEventRecord(s->timed, stream);
  if (err == cudaSuccess)
    err = cudaMemcpyAsync(s->rows, ident.untyped_data(),
                          n_rows * 3 * sizeof(int32_t), cudaMemcpyDeviceToHost,
                          stream);
  if (err == cudaSuccess) err = cudaEventRecord(s->done, stream);
  if (err != cudaSuccess) {
    pool->Release(s);
    return CudaError(kind, "recording the fence event", err);
  }
  pool->Enqueue(stream, s);
  return ffi::Error::Success();
}

ffi::Error FenceCuda(int32_t kind, cudaStream_t stream, ffi::RemainingArgs args,
                     ffi::RemainingRets rets) {
  std::vector<ffi::AnyBuffer> ins;
  std::vector<ffi::Result<ffi::AnyBuffer>> outs;
  std::optional<ffi::AnyBuffer> ident;
  ffi::Error err = ValidateFence(kind, args, rets, &ins, &outs, &ident);
  if (err.failure()) return err;
  // begin: stamped before its copies (the inputs are ready); end: after them.
  if (kind == 0) {
    err = Stamp(kind, stream, *ident);
    if (err.failure()) return err;
  }
  // Zero-copy when XLA aliased ret i to arg i (donated); otherwise an async
  // device-to-device copy on the same stream, ordered with everything else.
  for (size_t i = 0; i < ins.size(); ++i) {
    void* src = ins[i].untyped_data();
    void* dst = outs[i]->untyped_data();
    const size_t n = ins[i].size_bytes();
    if (src == dst || n == 0) continue;
    cudaError_t cerr =
        cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, stream);
    if (cerr != cudaSuccess) return CudaError(kind, "cudaMemcpyAsync", cerr);
  }
  if (kind == 1) return Stamp(kind, stream, *ident);
  return ffi::Error::Success();
}

ffi::Error FenceBeginCuda(cudaStream_t stream, ffi::RemainingArgs args,
                          ffi::RemainingRets rets) {
  return FenceCuda(0, stream, args, rets);
}

ffi::Error FenceEndCuda(cudaStream_t stream, ffi::RemainingArgs args,
                        ffi::RemainingRets rets) {
  return FenceCuda(1, stream, args, rets);
}

}  // namespace
}  // namespace xshare

#ifndef XSHARE_SRC_HASH
#define XSHARE_SRC_HASH "unknown"
#endif
#ifndef XSHARE_JAXLIB
#define XSHARE_JAXLIB "xshare-jaxlib:unknown"
#endif

extern "C" {

int32_t xshare_cuda_abi_version() { return 2; }
const char* xshare_cuda_src_hash() { return XSHARE_SRC_HASH; }
const char* xshare_cuda_built_for_jaxlib() { return XSHARE_JAXLIB; }

// Reads back every completed fence event into the rings (oldest first per
// stream); returns how many fences completed. Python calls it before draining.
int64_t xshare_cuda_poll() {
  std::vector<xshare::DevicePool*> pools;
  {
    std::lock_guard<std::mutex> lock(xshare::g_pools_mu);
    for (auto& kv : xshare::Pools()) pools.push_back(kv.second);
  }
  int64_t n = 0;
  for (auto* p : pools) n += p->Poll();
  return n;
}

// Fences enqueued whose events have not been read back yet.
int64_t xshare_cuda_pending() {
  std::lock_guard<std::mutex> lock(xshare::g_pools_mu);
  int64_t n = 0;
  for (auto& kv : xshare::Pools()) n += kv.second->Pending();
  return n;
}

// Fence executions that produced no record (pool full, ring closed before the
// read-back, CUDA error on the stream).
int64_t xshare_cuda_lost() { return xshare::g_lost.load(); }

}  // extern "C"

// No attributes: nothing about the job is baked into the program.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    XshareFenceBeginCuda, xshare::FenceBeginCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
        .RemainingArgs()    // the step's inputs, then the ident (device
                            // memory) int32[..., 3]
        .RemainingRets());  // the step's inputs again (aliased when donated)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    XshareFenceEndCuda, xshare::FenceEndCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .RemainingArgs()    // passed-through leaves, the step's other outputs
                            // (dependencies only), then the ident
        .RemainingRets());  // the passed-through leaves (aliased)
