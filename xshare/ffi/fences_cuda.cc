// xshare XLA FFI fences, CUDA handlers (registered with platform="CUDA").
//
// Host-only code (no kernels): builds with g++ against the CUDA headers and
// links cudart. Linked against libxshare_fences.so, which owns the rings, the
// lane table, the clock and the validation, so CPU and CUDA fences share them.
//
// On CUDA the handler runs on the host when XLA *enqueues* the fence, not when
// the GPU reaches it. So the timestamp is taken by a host function launched on
// the same stream (cudaLaunchHostFunc): it runs once everything enqueued
// before it on the stream has finished. `begin` launches it before its copies,
// `end` after, so [begin, end] brackets the step's device work.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// From libxshare_fences.so (fences.cc).
namespace xshare {
ffi::Error ValidateFence(int32_t kind, const ffi::RemainingArgs& args,
                         const ffi::RemainingRets& rets, int32_t ring_id,
                         int32_t lane_id, std::vector<ffi::AnyBuffer>* ins,
                         std::vector<ffi::Result<ffi::AnyBuffer>>* outs);
const char* FenceName(int32_t kind);
}  // namespace xshare
extern "C" int32_t xshare_record(int32_t ring_id, int32_t job_id,
                                 int32_t lane_id, int32_t kind);

namespace xshare {
namespace {

struct Stamp {
  int32_t ring_id, job_id, lane_id, kind;
};

// Runs on a CUDA driver thread when the stream reaches the fence. Must not call
// CUDA. A ring closed in the meantime makes xshare_record return -1: the record
// is dropped silently (there is nobody left to read it).
void CUDART_CB RecordOnStream(void* data) {
  Stamp* s = static_cast<Stamp*>(data);
  xshare_record(s->ring_id, s->job_id, s->lane_id, s->kind);
  delete s;
}

ffi::Error CudaError(int32_t kind, const char* what, cudaError_t err) {
  std::ostringstream os;
  os << FenceName(kind) << ": " << what << " failed: " << cudaGetErrorName(err)
     << " (" << cudaGetErrorString(err) << ")";
  return ffi::Error::Internal(os.str());
}

ffi::Error Stamp1(int32_t kind, cudaStream_t stream, int32_t ring_id,
                  int32_t job_id, int32_t lane_id) {
  Stamp* s = new Stamp{ring_id, job_id, lane_id, kind};
  cudaError_t err = cudaLaunchHostFunc(stream, RecordOnStream, s);
  if (err != cudaSuccess) {
    delete s;
    return CudaError(kind, "cudaLaunchHostFunc", err);
  }
  return ffi::Error::Success();
}

ffi::Error FenceCuda(int32_t kind, cudaStream_t stream, ffi::RemainingArgs args,
                     ffi::RemainingRets rets, int32_t ring_id, int32_t job_id,
                     int32_t lane_id) {
  std::vector<ffi::AnyBuffer> ins;
  std::vector<ffi::Result<ffi::AnyBuffer>> outs;
  ffi::Error err =
      ValidateFence(kind, args, rets, ring_id, lane_id, &ins, &outs);
  if (err.failure()) return err;
  if (kind == 0) {
    err = Stamp1(kind, stream, ring_id, job_id, lane_id);
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
  if (kind == 1) return Stamp1(kind, stream, ring_id, job_id, lane_id);
  return ffi::Error::Success();
}

ffi::Error FenceBeginCuda(cudaStream_t stream, ffi::RemainingArgs args,
                          ffi::RemainingRets rets, int32_t ring_id,
                          int32_t job_id, int32_t lane_id) {
  return FenceCuda(0, stream, args, rets, ring_id, job_id, lane_id);
}

ffi::Error FenceEndCuda(cudaStream_t stream, ffi::RemainingArgs args,
                        ffi::RemainingRets rets, int32_t ring_id,
                        int32_t job_id, int32_t lane_id) {
  return FenceCuda(1, stream, args, rets, ring_id, job_id, lane_id);
}

}  // namespace
}  // namespace xshare

#ifndef XSHARE_SRC_HASH
#define XSHARE_SRC_HASH "unknown"
#endif

extern "C" int32_t xshare_cuda_abi_version() { return 1; }
extern "C" const char* xshare_cuda_src_hash() { return XSHARE_SRC_HASH; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    XshareFenceBeginCuda, xshare::FenceBeginCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's compute stream
        .RemainingArgs()             // the step's inputs, any dtype/shape
        .RemainingRets()             // the same buffers (aliased when donated)
        .Attr<int32_t>("ring_id")    // ring to record into (open_ring)
        .Attr<int32_t>("job_id")     // recorded as-is
        .Attr<int32_t>("lane_id"));  // -1: lane from set_lane(job_id, lane)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    XshareFenceEndCuda, xshare::FenceEndCuda,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .RemainingArgs()             // passed-through leaves, then the step's other outputs
        .RemainingRets()             // the passed-through leaves (aliased); the rest: deps only
        .Attr<int32_t>("ring_id")
        .Attr<int32_t>("job_id")
        .Attr<int32_t>("lane_id"));
