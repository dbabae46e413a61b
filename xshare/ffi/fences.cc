// xshare XLA FFI fences (host side, CPU handlers).
//
// `xshare_fence_begin` / `xshare_fence_end` are identity custom calls over a
// variadic list of buffers. The runtime places `begin` over every input of a
// job's step and `end` over every output, with input_output_aliases={i: i}, so
// with donated buffers XLA hands us the same pointer for arg i and ret i and
// the fence is zero-copy. Ordering comes only from data dependencies: every op
// of the step consumes a `begin` result, `end` consumes every step output.
//
// Identity is data, not attributes: the last operand of both fences is `ident`,
// an int32[..., 3] buffer of rows [ring_id, job_id, lane_id]. It is not aliased
// and not returned. With no attributes the compiled program does not depend on
// which job runs it, so N identical jobs share one executable and each passes
// its own ident at every call (issue #13). A fused (vmapped) step passes one
// row per member; rows equal to the previous row are recorded once (an
// unbatched ident that vmap broadcast to every member is one job).
//
// Each call appends one Record {seq, t_ns, job, lane, kind} per ident row to
// the ring `ring_id`. Rings are opened, drained and closed from Python through
// the C ABI at the bottom of this file (loaded with ctypes). The CUDA handlers
// (fences_cuda.cc, a separate library linked against this one) record through
// `xshare_record_at`, so both share the same rings and clock.
//
// Errors are returned as ffi::Error, never thrown: XLA turns them into a
// Python exception at execution time and the process keeps running.

#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Bumped whenever the C ABI below or the handlers' operands change; Python
// refuses a library whose version differs (and rebuilds it).
// 2: identity as an int32[..., 3] operand instead of three attributes.
#define XSHARE_FFI_ABI_VERSION 2

#ifndef XSHARE_SRC_HASH
#define XSHARE_SRC_HASH "unknown"
#endif
// The jaxlib whose FFI headers this library was compiled against (set by
// _build.py). A jaxlib with another FFI API may reject the handlers at
// registration, so Python rebuilds for the running jaxlib when they differ.
#ifndef XSHARE_JAXLIB
#define XSHARE_JAXLIB "xshare-jaxlib:unknown"
#endif

namespace xshare {

// Layout shared with Python: numpy dtype
// [('seq','u8'),('t_ns','i8'),('job','i4'),('lane','i4'),('kind','i4')]
// (28 bytes, unaligned, hence packed).
#pragma pack(push, 1)
struct Record {
  uint64_t seq;
  int64_t t_ns;
  int32_t job;
  int32_t lane;
  int32_t kind;  // 0 = begin, 1 = end
};
#pragma pack(pop)
static_assert(sizeof(Record) == 28, "Record must match the numpy dtype");

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Fixed-capacity ring: a circular array; when full, the oldest record is
// overwritten and counted in `dropped`. `seq` counts every record ever
// pushed (dropped ones included), so gaps in drained seqs show drops.
// The array is left uninitialized (`new Record[n]`, not a std::vector's
// zeroed elements): a slot is read only after it is written, and the pages
// of a runtime's 7 MiB ring are then touched as records reach them, not all at
// `open` (zeroing them held a runtime's start ~3 ms).
class Ring {
 public:
  explicit Ring(size_t capacity) : buf_(new Record[capacity]), cap_(capacity) {}

  void Push(int32_t job, int32_t lane, int32_t kind, int64_t t_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t cap = cap_;
    size_t slot;
    if (size_ == cap) {  // full: overwrite the oldest
      slot = head_;
      head_ = (head_ + 1) % cap;
      ++dropped_;
    } else {
      slot = (head_ + size_) % cap;
      ++size_;
    }
    buf_[slot] = Record{next_seq_++, t_ns, job, lane, kind};
  }

  // Moves up to `max` oldest records into `out`; returns how many.
  size_t Drain(Record* out, size_t max) {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t n = size_ < max ? size_ : max;
    const size_t cap = cap_;
    for (size_t i = 0; i < n; ++i) out[i] = buf_[(head_ + i) % cap];
    head_ = (head_ + n) % cap;
    size_ -= n;
    return n;
  }

  size_t Size() {
    std::lock_guard<std::mutex> lock(mu_);
    return size_;
  }

  uint64_t Dropped() {
    std::lock_guard<std::mutex> lock(mu_);
    return dropped_;
  }

 private:
  std::mutex mu_;
  std::unique_ptr<Record[]> buf_;
  size_t cap_;
  size_t head_ = 0;
  size_t size_ = 0;
  uint64_t next_seq_ = 0;
  uint64_t dropped_ = 0;
};

// Rings by id. Ids are never reused, so an executable compiled against a
// closed ring fails with "unknown ring_id" instead of writing into a stranger's
// ring. Recording takes the registry lock shared (concurrent fences of many
// jobs do not serialize on it) and the ring's own mutex for a few stores.
struct Registry {
  std::shared_mutex mu;
  std::unordered_map<int32_t, std::unique_ptr<Ring>> rings;
  int32_t next_id = 1;

  std::shared_mutex lanes_mu;
  std::unordered_map<int32_t, int32_t> lanes;  // job_id -> lane_id
};

Registry& Reg() {
  static Registry* r = new Registry();  // never destroyed: handlers may run late
  return *r;
}

int32_t ResolveLane(int32_t job_id, int32_t lane_id) {
  if (lane_id != -1) return lane_id;
  Registry& r = Reg();
  std::shared_lock<std::shared_mutex> lock(r.lanes_mu);
  auto it = r.lanes.find(job_id);
  return it == r.lanes.end() ? -1 : it->second;
}

// Returns false when the ring does not exist.
bool Record1(int32_t ring_id, int32_t job_id, int32_t lane_id, int32_t kind,
             int64_t t_ns) {
  Registry& r = Reg();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  auto it = r.rings.find(ring_id);
  if (it == r.rings.end()) return false;
  it->second->Push(job_id, lane_id, kind, t_ns);
  return true;
}

bool RingExists(int32_t ring_id) {
  Registry& r = Reg();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  return r.rings.count(ring_id) != 0;
}

const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::PRED: return "bool";
    case ffi::S8: return "int8";
    case ffi::S16: return "int16";
    case ffi::S32: return "int32";
    case ffi::S64: return "int64";
    case ffi::U8: return "uint8";
    case ffi::U16: return "uint16";
    case ffi::U32: return "uint32";
    case ffi::U64: return "uint64";
    case ffi::F16: return "float16";
    case ffi::BF16: return "bfloat16";
    case ffi::F32: return "float32";
    case ffi::F64: return "float64";
    case ffi::C64: return "complex64";
    case ffi::C128: return "complex128";
    default: return nullptr;
  }
}

std::string DescribeBuffer(const ffi::AnyBuffer& b) {
  std::ostringstream os;
  if (const char* n = DtypeName(b.element_type())) {
    os << n;
  } else {
    os << "xla_dtype_" << static_cast<int>(b.element_type());
  }
  os << "[";
  auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? "," : "") << dims[i];
  os << "] (" << b.size_bytes() << " bytes)";
  return os.str();
}

const char* FenceName(int32_t kind) {
  return kind == 0 ? "xshare_fence_begin" : "xshare_fence_end";
}

// Checks the buffers of a fence call; on success fills the buffer lists and
// the ident buffer. Shared by the CPU and the CUDA handlers
// (libxshare_fences_cuda.so links against this library and calls it; both are
// always built together). Does not read the ident's values: on CUDA they live
// in device memory.
ffi::Error ValidateFence(int32_t kind, const ffi::RemainingArgs& args,
                         const ffi::RemainingRets& rets,
                         std::vector<ffi::AnyBuffer>* ins,
                         std::vector<ffi::Result<ffi::AnyBuffer>>* outs,
                         std::optional<ffi::AnyBuffer>* ident) {
  const char* name = FenceName(kind);
  // Operands: the passed-through buffers (one per result), then for `end` any
  // dependencies (read by no one: the fence runs after they are computed
  // without being written in place, which would make XLA copy the step's new
  // state out of the way), then the ident, always last.
  const size_t n_args = args.size();
  const bool ok = n_args >= 1 &&
                  (kind == 0 ? n_args - 1 == rets.size()
                             : n_args - 1 >= rets.size() && rets.size() > 0);
  if (!ok) {
    std::ostringstream os;
    os << name << ": "
       << (kind == 0 ? "an identity fence needs as many results as arguments "
                       "before the ident"
                     : "an end fence needs at least one result and no more "
                       "results than arguments before the ident")
       << ", got " << n_args << " arguments (the last is the ident) and "
       << rets.size() << " results";
    return ffi::Error::InvalidArgument(os.str());
  }
  auto id = args.get<ffi::AnyBuffer>(n_args - 1);
  if (id.has_error()) {
    std::ostringstream os;
    os << name << ": the ident (last argument) is not a buffer: "
       << id.error().message();
    return ffi::Error::InvalidArgument(os.str());
  }
  {
    const ffi::AnyBuffer& b = id.value();
    auto dims = b.dimensions();
    if (b.element_type() != ffi::S32 || dims.size() == 0 ||
        dims[dims.size() - 1] != 3 || b.element_count() == 0) {
      std::ostringstream os;
      os << name << ": the ident (last argument) must be int32[..., 3] "
         << "rows of [ring_id, job_id, lane_id] (build it with "
         << "xshare.ffi.ident), got " << DescribeBuffer(b);
      return ffi::Error::InvalidArgument(os.str());
    }
    ident->emplace(b);
  }
  ins->reserve(rets.size());
  outs->reserve(rets.size());
  for (size_t i = rets.size(); i + 1 < n_args; ++i) {  // dependencies only
    auto dep = args.get<ffi::AnyBuffer>(i);
    if (dep.has_error()) {
      std::ostringstream os;
      os << name << ": argument " << i << " is not a buffer: "
         << dep.error().message();
      return ffi::Error::InvalidArgument(os.str());
    }
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    if (in.has_error()) {
      std::ostringstream os;
      os << name << ": argument " << i << " is not a buffer: "
         << in.error().message();
      return ffi::Error::InvalidArgument(os.str());
    }
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (out.has_error()) {
      std::ostringstream os;
      os << name << ": result " << i << " is not a buffer: "
         << out.error().message();
      return ffi::Error::InvalidArgument(os.str());
    }
    const ffi::AnyBuffer& a = in.value();
    const ffi::AnyBuffer& b = *out.value();
    bool same_dims = a.dimensions().size() == b.dimensions().size();
    for (size_t d = 0; same_dims && d < a.dimensions().size(); ++d)
      same_dims = a.dimensions()[d] == b.dimensions()[d];
    if (a.element_type() != b.element_type() || !same_dims ||
        a.size_bytes() != b.size_bytes()) {
      std::ostringstream os;
      os << name << ": result " << i << " must match argument " << i
         << " (identity fence): argument is " << DescribeBuffer(a)
         << ", result is " << DescribeBuffer(b);
      return ffi::Error::InvalidArgument(os.str());
    }
    ins->push_back(a);
    outs->push_back(out.value());
  }
  return ffi::Error::Success();
}

// Checks ident rows already in host memory: ring known, lane >= -1. Row-wise
// so that a fused step names the member at fault.
ffi::Error CheckIdentRows(int32_t kind, const int32_t* rows, size_t n_rows) {
  for (size_t r = 0; r < n_rows; ++r) {
    const int32_t ring_id = rows[3 * r], lane_id = rows[3 * r + 2];
    if (lane_id < -1) {
      std::ostringstream os;
      os << FenceName(kind) << ": lane_id must be >= 0, or -1 to use the lane "
         << "set with set_lane(job_id, lane); got " << lane_id << " (ident row "
         << r << ")";
      return ffi::Error::InvalidArgument(os.str());
    }
    if (!RingExists(ring_id)) {
      std::ostringstream os;
      os << FenceName(kind) << ": unknown ring_id " << ring_id
         << " (never opened, or already closed; ident row " << r << ")";
      return ffi::Error::InvalidArgument(os.str());
    }
  }
  return ffi::Error::Success();
}

// Records one fence execution: one record per ident row, skipping a row equal
// to the previous one. Returns the first ring that no longer exists, or 0.
int32_t RecordRows(int32_t kind, const int32_t* rows, size_t n_rows,
                   int64_t t_ns) {
  for (size_t r = 0; r < n_rows; ++r) {
    const int32_t* row = rows + 3 * r;
    if (r > 0 && std::memcmp(row, row - 3, 3 * sizeof(int32_t)) == 0) continue;
    if (!Record1(row[0], row[1], ResolveLane(row[1], row[2]), kind, t_ns))
      return row[0] == 0 ? -1 : row[0];
  }
  return 0;
}

// CPU fence. With donation XLA aliases ret i to arg i and there is nothing to
// copy; otherwise (not donated, or XLA chose not to alias) we copy, because
// the result must hold the value either way.
ffi::Error FenceCpu(int32_t kind, ffi::RemainingArgs args,
                    ffi::RemainingRets rets) {
  // Timestamp first: for `begin` this is the moment every input is ready.
  const int64_t t_begin = NowNs();
  std::vector<ffi::AnyBuffer> ins;
  std::vector<ffi::Result<ffi::AnyBuffer>> outs;
  std::optional<ffi::AnyBuffer> ident;
  ffi::Error err = ValidateFence(kind, args, rets, &ins, &outs, &ident);
  if (err.failure()) return err;
  // On CPU the ident is host memory: read it in place.
  const int32_t* rows = static_cast<const int32_t*>(ident->untyped_data());
  const size_t n_rows = ident->element_count() / 3;
  err = CheckIdentRows(kind, rows, n_rows);
  if (err.failure()) return err;
  for (size_t i = 0; i < ins.size(); ++i) {
    void* src = ins[i].untyped_data();
    void* dst = outs[i]->untyped_data();
    const size_t n = ins[i].size_bytes();
    if (src != dst && n != 0) std::memcpy(dst, src, n);
  }
  const int64_t t = kind == 0 ? t_begin : NowNs();
  if (int32_t gone = RecordRows(kind, rows, n_rows, t)) {
    std::ostringstream os;
    os << FenceName(kind) << ": ring_id " << gone
       << " was closed while the fence ran";
    return ffi::Error::InvalidArgument(os.str());
  }
  return ffi::Error::Success();
}

ffi::Error FenceBeginCpu(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return FenceCpu(0, args, rets);
}

ffi::Error FenceEndCpu(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return FenceCpu(1, args, rets);
}

}  // namespace xshare

// Handler symbols, looked up by name from Python (ctypes) and wrapped with
// jax.ffi.pycapsule. Exported with default visibility: do not build with
// -fvisibility=hidden.
// No attributes: nothing about the job is baked into the program.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    XshareFenceBegin, xshare::FenceBeginCpu,
    ffi::Ffi::Bind()
        .RemainingArgs()    // the step's inputs (any dtype/shape), then the
                            // ident int32[..., 3]: [ring_id, job_id, lane_id]
                            // rows (lane -1: from set_lane(job_id, lane))
        .RemainingRets());  // the step's inputs again (aliased when donated)

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    XshareFenceEnd, xshare::FenceEndCpu,
    ffi::Ffi::Bind()
        .RemainingArgs()    // passed-through leaves, then the step's other
                            // outputs (dependencies only), then the ident
        .RemainingRets());  // the passed-through leaves (aliased)

// ---------------------------------------------------------------------------
// C ABI for ctypes (and for the CUDA library's host callbacks).
// Negative returns mean "unknown ring" / "bad argument"; nothing throws.
// ---------------------------------------------------------------------------
extern "C" {

int32_t xshare_abi_version() { return XSHARE_FFI_ABI_VERSION; }

// Hash of the sources this library was built from (set by _build.py), so a
// stale library next to edited sources is detected and rebuilt.
const char* xshare_src_hash() { return XSHARE_SRC_HASH; }

// The jaxlib version whose headers this library was compiled against, and
// the XLA FFI API version of those headers (major * 1000 + minor).
const char* xshare_built_for_jaxlib() { return XSHARE_JAXLIB; }
int32_t xshare_ffi_api_version() {
  return XLA_FFI_API_MAJOR * 1000 + XLA_FFI_API_MINOR;
}

int64_t xshare_now_ns() { return xshare::NowNs(); }

// Returns a new ring id (>= 1), or -1 if capacity < 1.
int32_t xshare_ring_open(int64_t capacity) {
  if (capacity < 1) return -1;
  xshare::Registry& r = xshare::Reg();
  auto ring = std::make_unique<xshare::Ring>(static_cast<size_t>(capacity));
  std::unique_lock<std::shared_mutex> lock(r.mu);
  int32_t id = r.next_id++;
  r.rings.emplace(id, std::move(ring));
  return id;
}

// 0 on success, -1 if the ring is unknown.
int32_t xshare_ring_close(int32_t ring_id) {
  xshare::Registry& r = xshare::Reg();
  std::unique_ptr<xshare::Ring> dead;
  {
    std::unique_lock<std::shared_mutex> lock(r.mu);
    auto it = r.rings.find(ring_id);
    if (it == r.rings.end()) return -1;
    dead = std::move(it->second);
    r.rings.erase(it);
  }
  return 0;  // `dead` freed outside the lock
}

// Records currently held, or -1 if the ring is unknown.
int64_t xshare_ring_size(int32_t ring_id) {
  xshare::Registry& r = xshare::Reg();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  auto it = r.rings.find(ring_id);
  return it == r.rings.end() ? -1 : static_cast<int64_t>(it->second->Size());
}

// Moves up to `max` oldest records into `out` (28-byte Records); returns the
// count, or -1 if the ring is unknown.
int64_t xshare_ring_drain(int32_t ring_id, void* out, int64_t max) {
  if (max < 0 || (max > 0 && out == nullptr)) return -2;
  xshare::Registry& r = xshare::Reg();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  auto it = r.rings.find(ring_id);
  if (it == r.rings.end()) return -1;
  return static_cast<int64_t>(it->second->Drain(
      static_cast<xshare::Record*>(out), static_cast<size_t>(max)));
}

// Records overwritten because the ring was full, or -1 if unknown.
int64_t xshare_ring_dropped(int32_t ring_id) {
  xshare::Registry& r = xshare::Reg();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  auto it = r.rings.find(ring_id);
  return it == r.rings.end() ? -1
                             : static_cast<int64_t>(it->second->Dropped());
}

// Lane table for fences compiled with lane_id = -1. lane_id = -1 unsets.
void xshare_set_lane(int32_t job_id, int32_t lane_id) {
  xshare::Registry& r = xshare::Reg();
  std::unique_lock<std::shared_mutex> lock(r.lanes_mu);
  if (lane_id < 0) {
    r.lanes.erase(job_id);
  } else {
    r.lanes[job_id] = lane_id;
  }
}

int32_t xshare_get_lane(int32_t job_id) {
  return xshare::ResolveLane(job_id, -1);
}

// Records one fence execution at time `t_ns` (the fences' clock): one record
// per ident row (int32[3 * n_rows]), lanes resolved now. Used by the CUDA
// library when it reads back a completed event. 0 on success, else the first
// ring id that no longer exists (-1 for ring 0).
int32_t xshare_record_rows(const int32_t* rows, int64_t n_rows, int32_t kind,
                           int64_t t_ns) {
  if (rows == nullptr || n_rows < 0) return -1;
  return xshare::RecordRows(kind, rows, static_cast<size_t>(n_rows), t_ns);
}

// One record stamped now (tests, and callers with a host-side event).
// 0 on success, -1 if the ring is unknown (closed).
int32_t xshare_record(int32_t ring_id, int32_t job_id, int32_t lane_id,
                      int32_t kind) {
  const int64_t t = xshare::NowNs();
  return xshare::Record1(ring_id, job_id, xshare::ResolveLane(job_id, lane_id),
                         kind, t)
             ? 0
             : -1;
}

int32_t xshare_ring_exists(int32_t ring_id) {
  return xshare::RingExists(ring_id) ? 1 : 0;
}

}  // extern "C"
