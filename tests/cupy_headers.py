"""Stand-ins for the headers CuPy v14 prepends to every kernel module it compiles, for
`tests/nvrtc.py`: the generated kernels compile for sm_90 with NVRTC on a machine without CuPy's
own headers (with the real CuPy installed, its headers are used instead)."""
from __future__ import annotations

#: Stand-ins for the headers CuPy prepends (`core.pyx`: `cupy_header_list`) and the float16 one
#: its type declarations include, with the members the generated kernels use, as CuPy v14
#: declares them.
STANDIN_HEADERS = {
    "cupy/complex.cuh": "#pragma once\n",
    "cupy/atomics.cuh": "#pragma once\n",
    "cupy/math_constants.h": "#pragma once\n",
    "cupy/carray.cuh": r"""
#pragma once
namespace cupy {
namespace type_traits {
template <bool B, class T, class F> struct conditional { typedef T type; };
template <class T, class F> struct conditional<false, T, F> { typedef F type; };
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };
template <typename T, typename U> struct is_same { static const bool value = false; };
template <typename T> struct is_same<T, T> { static const bool value = true; };
}
}
class bfloat16;
class float16;

#define CUPY_FOR(i, n) \
    for (ptrdiff_t i = static_cast<ptrdiff_t>(blockIdx.x) * blockDim.x + threadIdx.x; \
         i < (n); i += static_cast<ptrdiff_t>(blockDim.x) * gridDim.x)

template <typename T, int _ndim, bool _c_contiguous = false, bool _use_32bit_indexing = false>
class CArray {
 public:
  static const int ndim = _ndim;
  static const bool c_contiguous = _c_contiguous;
  typedef typename cupy::type_traits::conditional<_use_32bit_indexing, int, ptrdiff_t>::type
      index_t;
 private:
  T* data_;
  ptrdiff_t size_;
  ptrdiff_t shape_[ndim];
  ptrdiff_t strides_[ndim];
 public:
  __device__ ptrdiff_t size() const { return size_; }
  __device__ const ptrdiff_t* shape() const { return shape_; }
  __device__ const ptrdiff_t* strides() const { return strides_; }
  template <typename Int>
  __device__ T& operator[](const Int (&idx)[ndim]) {
    return const_cast<T&>(const_cast<const CArray&>(*this)[idx]);
  }
  template <typename Int>
  __device__ const T& operator[](const Int (&idx)[ndim]) const {
    index_t diff = 0;
    for (int dim = 0; dim < ndim; ++dim)
      diff += static_cast<index_t>(strides_[dim]) * static_cast<index_t>(idx[dim]);
    return *reinterpret_cast<const T*>(reinterpret_cast<const char*>(data_) + diff);
  }
  __device__ T& operator[](ptrdiff_t i) {
    return const_cast<T&>(const_cast<const CArray&>(*this)[i]);
  }
  __device__ const T& operator[](ptrdiff_t idx) const {
    if (c_contiguous) return data_[idx];
    index_t diff = 0;
    index_t i = static_cast<index_t>(idx);
    for (int dim = ndim; --dim > 0; ) {
      index_t shape_dim = static_cast<index_t>(shape_[dim]);
      diff += static_cast<index_t>(strides_[dim]) * (i % shape_dim);
      i /= shape_dim;
    }
    diff += static_cast<index_t>(strides_[0]) * i;
    return *reinterpret_cast<const T*>(reinterpret_cast<const char*>(data_) + diff);
  }
};

template <typename T, bool _use_32bit_indexing>
class CArray<T, 0, true, _use_32bit_indexing> {
 private:
  T* data_;
  ptrdiff_t size_;
 public:
  static const int ndim = 0;
  __device__ ptrdiff_t size() const { return size_; }
  template <typename U> __device__ T& operator[](const U&) { return *data_; }
  template <typename U> __device__ T operator[](const U&) const { return *data_; }
};

template <int _ndim, bool _use_32bit_indexing = false>
class CIndexer {
 public:
  static const int ndim = _ndim;
 private:
  ptrdiff_t size_;
  ptrdiff_t shape_[ndim];
  ptrdiff_t index_[ndim];
  typedef ptrdiff_t index_t[ndim];
 public:
  __device__ ptrdiff_t size() const { return size_; }
  __device__ const index_t& get() const { return index_; }
  __device__ void set(ptrdiff_t i) {
    if (ndim == 1) { index_[0] = i; return; }
    if (!_use_32bit_indexing && size_ > 1LL << 31) _set(static_cast<unsigned long long>(i));
    else _set(static_cast<unsigned int>(i));
  }
 private:
  template <typename I>
  __device__ void _set(I i) {
    for (int dim = ndim; --dim > 0; ) {
      I s = static_cast<I>(shape_[dim]);
      I t = i / s;
      index_[dim] = i - t * s;
      i = t;
    }
    index_[0] = i;
  }
};

template <bool _use_32bit_indexing>
class CIndexer<0, _use_32bit_indexing> {
 private:
  ptrdiff_t size_;
 public:
  static const int ndim = 0;
  __device__ ptrdiff_t size() const { return size_; }
  __device__ void set(ptrdiff_t i) {}
  __device__ const ptrdiff_t* get() const { return NULL; }
};
""",
    "cupy/float16.cuh": r"""
#pragma once
#include "cupy/carray.cuh"
#include <cuda_fp16.h>
class float16 {
 private:
  half data_;
 public:
  __device__ float16() {}
  __device__ float16(float v) : data_(v) {}
  explicit __device__ float16(bool v) : data_(float(v)) {}
  explicit __device__ float16(double v) : data_(v) {}
  explicit __device__ float16(int v) : data_(v) {}
  explicit __device__ float16(unsigned int v) : data_(v) {}
  explicit __device__ float16(long long v) : data_(v) {}
  explicit __device__ float16(unsigned long long v) : data_(v) {}
  explicit __device__ float16(const half& v) : data_(v) {}
  explicit __device__ float16(const __half_raw& v) : data_(v) {}
  __device__ operator float() const { return float(data_); }
  float16& operator=(const float16&) = default;
  template <typename T>
  __device__ float16& operator=(const T& rhs) {
    *this = static_cast<float16>(rhs);
    return *this;
  }
};
""",
}

#: what CuPy prepends to every module it compiles (`core.pyx`, `_cupy_header`)
CUPY_HEADER = "".join(f"#include <{h}>\n" for h in
                      ("cupy/complex.cuh", "cupy/carray.cuh", "cupy/atomics.cuh",
                       "cupy/math_constants.h"))
