// The per-thread side of the CUDA reduce kernels: element types, memory
// access, the split of a buffer into head, vector body and tail, and the ops.
// Private to gpu_reduce.cu, which includes it inside its anonymous namespace
// after the constants and BPS_HD it relies on; everything here is
// __host__ __device__ so the CPU emulation runs the same code.
#ifndef BPS_TF_KERNELS_GPU_REDUCE_OPS_CUH_
#define BPS_TF_KERNELS_GPU_REDUCE_OPS_CUH_

// ---- element types: how a value is stored and in which type it adds up ----

// float16 and bfloat16: 16 bits stored, float to add in. Only the
// conversions differ. They go through the __*_raw structs, whose conversions
// are __host__ __device__ in every CUDA release, unlike some of the bit-cast
// intrinsics.
template <typename Raw, typename Value, typename Convert>
struct Float16Like {
  using Storage = uint16_t;
  using Acc = float;
  static constexpr bool kInteger = false;
  static BPS_HD float ToAcc(uint16_t bits) {
    Raw r;
    r.x = bits;
    return Convert::ToFloat(Value(r));
  }
  static BPS_HD uint16_t FromAcc(float f) { return Raw(Convert::FromFloat(f)).x; }
};

struct HalfConvert {
  static BPS_HD float ToFloat(__half v) { return __half2float(v); }
  static BPS_HD __half FromFloat(float f) { return __float2half_rn(f); }
};
struct BFloat16Convert {
  static BPS_HD float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
  static BPS_HD __nv_bfloat16 FromFloat(float f) { return __float2bfloat16_rn(f); }
};
using Half = Float16Like<__half_raw, __half, HalfConvert>;
using BFloat16 = Float16Like<__nv_bfloat16_raw, __nv_bfloat16, BFloat16Convert>;

template <typename T>
struct Plain {
  using Storage = T;
  using Acc = T;
  static constexpr bool kInteger = false;
  static BPS_HD T ToAcc(T v) { return v; }
  static BPS_HD T FromAcc(T v) { return v; }
};
using Float32 = Plain<float>;
using Float64 = Plain<double>;

// Integers add as unsigned so that overflow wraps (as in TensorFlow and the
// CPU path) instead of being undefined behaviour.
template <typename S, typename U>
struct Integer {
  using Storage = S;
  using Acc = U;
  static constexpr bool kInteger = true;
  static BPS_HD U ToAcc(S v) { return static_cast<U>(v); }
  static BPS_HD S FromAcc(U v) { return static_cast<S>(v); }
};
using Int32 = Integer<int32_t, uint32_t>;
using Int64 = Integer<int64_t, uint64_t>;

// ---- memory access ----

// One byte from the low bits of a 32-bit register. On the GPU the store is
// written in PTX so that the register really is 32 bits wide (see StoreAt).
BPS_HD void StoreByte(unsigned char* at, uint32_t low) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.u8 [%0], %1;" : : "l"(at), "r"(low) : "memory");
#else
  *at = static_cast<unsigned char>(low);
#endif
}

// Element access. `direct` is false only when some pointer is not a multiple
// of its element size (e.g. a float buffer at an odd byte address): then
// elements move byte by byte, slow but correct. The flag is the same for
// every thread of a launch, so the branch costs next to nothing, and one
// kernel per op and type (not two) keeps the compile short.
template <typename T>
BPS_HD T LoadAt(bool direct, const void* base, size_t i) {
  if (direct) return static_cast<const T*>(base)[i];
  T v;
  memcpy(&v, static_cast<const char*>(base) + i * sizeof(T), sizeof(T));
  return v;
}

// The bytewise store goes through a register of at least 32 bits. Storing
// the bytes of a 16-bit value straight from its 16-bit register (what
// memcpy compiles to) wrote a wrong low byte on an H200 with CUDA 13.0's
// ptxas, while the PTX was right; the same code from a 32-bit register is
// what the float and double paths compile to, and those were right.
template <typename T>
BPS_HD void StoreAt(bool direct, void* base, size_t i, T v) {
  if (direct) {
    static_cast<T*>(base)[i] = v;
    return;
  }
  using Word = typename std::conditional<sizeof(T) <= 4, uint32_t, uint64_t>::type;
  Word w = 0;
  memcpy(&w, &v, sizeof(T));  // little-endian: the value's bytes are w's low bytes
  unsigned char* at = static_cast<unsigned char*>(base) + i * sizeof(T);
#pragma unroll
  for (size_t k = 0; k < sizeof(T); ++k) StoreByte(at + k, static_cast<uint32_t>(w >> (8 * k)));
}

// 16 bytes seen as elements; used only at 16-byte aligned addresses.
template <typename T>
union Pack {
  uint4 raw;
  T e[kVecBytes / sizeof(T)];
};

#if defined(BPS_GPU_HOST_EMULATION)
// A misaligned vector access faults on the GPU but not always on the CPU: the
// emulation records it (and copies bytewise) so that tests catch it.
thread_local bool g_emulated_misaligned = false;
#if !defined(__CUDA_ARCH__)
inline void EmulatedCopy16(void* to, const void* from, const void* addr) {
  if (reinterpret_cast<uintptr_t>(addr) % kVecBytes != 0) g_emulated_misaligned = true;
  memcpy(to, from, kVecBytes);
}
#endif
#endif

template <typename T>
BPS_HD Pack<T> LoadPack(const void* base, size_t i) {
  const T* at = static_cast<const T*>(base) + i;
  Pack<T> p;
#if defined(BPS_GPU_HOST_EMULATION) && !defined(__CUDA_ARCH__)
  EmulatedCopy16(&p.raw, at, at);
#else
  p.raw = *reinterpret_cast<const uint4*>(at);
#endif
  return p;
}

// 8 bytes of 16-bit values (the float16/bfloat16 side of a widening cast),
// used only at 8-byte aligned addresses.
union Pack8 {
  uint2 raw;
  uint16_t e[4];
};

BPS_HD Pack8 LoadPack8(const void* base, size_t i) {
  const uint16_t* at = static_cast<const uint16_t*>(base) + i;
  Pack8 p;
#if defined(BPS_GPU_HOST_EMULATION) && !defined(__CUDA_ARCH__)
  if (reinterpret_cast<uintptr_t>(at) % sizeof(uint2) != 0) g_emulated_misaligned = true;
  memcpy(&p.raw, at, sizeof(uint2));
#else
  p.raw = *reinterpret_cast<const uint2*>(at);
#endif
  return p;
}

template <typename T>
BPS_HD void StorePack(void* base, size_t i, const Pack<T>& p) {
  T* at = static_cast<T*>(base) + i;
#if defined(BPS_GPU_HOST_EMULATION) && !defined(__CUDA_ARCH__)
  EmulatedCopy16(at, &p.raw, at);
#else
  *reinterpret_cast<uint4*>(at) = p.raw;
#endif
}

// ---- work split ----

// Elements [0, head) and [head + nvec * kVec, count) one at a time; the
// vectors in between, each starting at an index where every pointer has the
// alignment its vector access needs. `direct`: every pointer is a multiple of
// its element size.
struct Span {
  size_t count;
  size_t head;
  size_t nvec;
  bool direct;
};

// Ops split a vector into Load (every read, and the arithmetic) and Store.
// (Two vectors per step, both loaded before either was stored, measured the
// same as one on an H200 at 16-256 MiB, so the loop stays simple.)
template <class Op>
BPS_HD void RunSpan(const Op& op, const Span& s, size_t tid, size_t nthreads) {
  for (size_t i = tid; i < s.head; i += nthreads) op.Element(i, s.direct);
  for (size_t v = tid; v < s.nvec; v += nthreads) {
    size_t a = s.head + v * Op::kVec;
    op.Store(a, op.Load(a));
  }
  for (size_t i = s.head + s.nvec * Op::kVec + tid; i < s.count; i += nthreads) {
    op.Element(i, s.direct);
  }
}

struct Ptr {
  const void* p;
  size_t elem;                // element size at this pointer
  size_t align = kVecBytes;   // alignment of its vector accesses
};

// Finds the vector body: the first index h < vec at which every pointer has
// its vector alignment. Buffers whose misalignments differ get no body (all
// scalar), and so do buffers not aligned to their element size.
Span PlanSpan(const Ptr* ptrs, int n, size_t count, int vec) {
  Span s{count, 0, 0, true};
  for (int k = 0; k < n; ++k) {
    if (reinterpret_cast<uintptr_t>(ptrs[k].p) % ptrs[k].elem != 0) s.direct = false;
  }
  if (!s.direct) return s;
  for (size_t h = 0; h < static_cast<size_t>(vec) && h < count; ++h) {
    bool ok = true;
    for (int k = 0; k < n && ok; ++k) {
      ok = (reinterpret_cast<uintptr_t>(ptrs[k].p) + h * ptrs[k].elem) % ptrs[k].align == 0;
    }
    if (ok) {
      s.head = h;
      s.nvec = (count - h) / vec;
      return s;
    }
  }
  return s;
}

// ---- ops: what one element and one vector of work do ----

template <class E>
struct SumOp {
  using S = typename E::Storage;
  using A = typename E::Acc;
  static constexpr int kVec = kVecBytes / sizeof(S);
  void* dst;
  const void* src[kMaxSrcs];
  int nsrcs;

  BPS_HD void Element(size_t i, bool direct) const {
    A acc = E::ToAcc(LoadAt<S>(direct, src[0], i));
    for (int k = 1; k < nsrcs; ++k) acc += E::ToAcc(LoadAt<S>(direct, src[k], i));
    StoreAt<S>(direct, dst, i, E::FromAcc(acc));
  }
  // Reads every source at i before dst at i is written: dst == src[0] is safe.
  BPS_HD Pack<S> Load(size_t i) const {
    A acc[kVec];
    Pack<S> in = LoadPack<S>(src[0], i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] = E::ToAcc(in.e[j]);
    for (int k = 1; k < nsrcs; ++k) {
      in = LoadPack<S>(src[k], i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] += E::ToAcc(in.e[j]);
    }
    Pack<S> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.e[j] = E::FromAcc(acc[j]);
    return out;
  }
  BPS_HD void Store(size_t i, const Pack<S>& out) const { StorePack<S>(dst, i, out); }
};

template <class E>
struct ScaleOp {
  using S = typename E::Storage;
  using A = typename E::Acc;
  static constexpr int kVec = kVecBytes / sizeof(S);
  void* data;
  A factor;

  BPS_HD S One(S v) const { return E::FromAcc(E::ToAcc(v) * factor); }
  BPS_HD void Element(size_t i, bool direct) const {
    StoreAt<S>(direct, data, i, One(LoadAt<S>(direct, data, i)));
  }
  BPS_HD Pack<S> Load(size_t i) const {
    Pack<S> p = LoadPack<S>(data, i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) p.e[j] = One(p.e[j]);
    return p;
  }
  BPS_HD void Store(size_t i, const Pack<S>& p) const { StorePack<S>(data, i, p); }
};

// numpy's `//`: the quotient rounded toward minus infinity. x // -1 is a
// negation that wraps (MIN // -1 == MIN, as numpy gives), never a trap.
template <class E>
BPS_HD typename E::Storage FloorDiv(typename E::Storage x, typename E::Storage d) {
  using S = typename E::Storage;
  if (d == -1) return E::FromAcc(typename E::Acc(0) - E::ToAcc(x));
  S q = x / d;
  S r = x % d;
  if (r != 0 && ((r < 0) != (d < 0))) --q;
  return q;
}

template <class E>
struct FloorDivOp {
  using S = typename E::Storage;
  static constexpr int kVec = kVecBytes / sizeof(S);
  void* data;
  S divisor;

  BPS_HD void Element(size_t i, bool direct) const {
    StoreAt<S>(direct, data, i, FloorDiv<E>(LoadAt<S>(direct, data, i), divisor));
  }
  BPS_HD Pack<S> Load(size_t i) const {
    Pack<S> p = LoadPack<S>(data, i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) p.e[j] = FloorDiv<E>(p.e[j], divisor);
    return p;
  }
  BPS_HD void Store(size_t i, const Pack<S>& p) const { StorePack<S>(data, i, p); }
};

// One vector = 4 half-width values: an 8-byte load and one 16-byte store, so
// that a warp's stores cover one contiguous run. (Two 16-byte stores per
// 16-byte load, each warp store touching every other 16 bytes, reached only
// 64-67 % of the copy bandwidth on an H200.)
template <class E>
struct ToF32Op {
  static constexpr int kVec = 4;
  float* dst;
  const void* src;

  BPS_HD void Element(size_t i, bool direct) const {
    StoreAt<float>(direct, dst, i, E::ToAcc(LoadAt<uint16_t>(direct, src, i)));
  }
  BPS_HD Pack<float> Load(size_t i) const {
    Pack8 in = LoadPack8(src, i);
    Pack<float> out;
#pragma unroll
    for (int j = 0; j < 4; ++j) out.e[j] = E::ToAcc(in.e[j]);
    return out;
  }
  BPS_HD void Store(size_t i, const Pack<float>& out) const { StorePack<float>(dst, i, out); }
};

template <class E>
struct FromF32Op {
  static constexpr int kVec = 8;
  void* dst;
  const float* src;

  BPS_HD void Element(size_t i, bool direct) const {
    StoreAt<uint16_t>(direct, dst, i, E::FromAcc(LoadAt<float>(direct, src, i)));
  }
  BPS_HD Pack<uint16_t> Load(size_t i) const {
    Pack<float> lo = LoadPack<float>(src, i);
    Pack<float> hi = LoadPack<float>(src, i + 4);
    Pack<uint16_t> out;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      out.e[j] = E::FromAcc(lo.e[j]);
      out.e[j + 4] = E::FromAcc(hi.e[j]);
    }
    return out;
  }
  BPS_HD void Store(size_t i, const Pack<uint16_t>& out) const {
    StorePack<uint16_t>(dst, i, out);
  }
};

#endif  // BPS_TF_KERNELS_GPU_REDUCE_OPS_CUH_
