"""The CUDA C the CuPy backend generates, compiled and run on the host: `HostKernels` batches the
`ElementwiseKernel` / `ReductionKernel` sources (`cuda_source`) into shared libraries built by g++
(`-ffp-contract=off`, as NVRTC's `--fmad=false`) and loads them with ctypes; `_call` runs one over
strided arrays. The kernel loop is CuPy's (broadcast operands, a reduction over the trailing
axes). Used by the CuPy stand-in (`fake_cupy`) and `bench/fma_check.py`."""
from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np

from einpage.runtime.backends import cuda_source

CXX = shutil.which("g++") or shutil.which("c++")

_CT = {"float16": "float16", "uint16": "unsigned short", "float32": "float",
       "float64": "double", "int64": "long long", "int32": "int",
       "uint8": "unsigned char"}  # uint8: packed (quantized) bytes, read raw by dequant kernels
_NP = {"float16": np.float16, "uint16": np.uint16, "float32": np.float32, "float64": np.float64,
       "int64": np.int64, "int32": np.int32, "uint8": np.uint8}

_HOST_HEADER = r"""
#include <math.h>
#include <string.h>
#include <stdbool.h>
#include <stddef.h>
struct float16 {
  _Float16 v;
  float16() {}
  float16(float f) : v((_Float16)f) {}
  operator float() const { return (float)v; }
};
template <class T> struct RawArr { T* p; T& operator[](long long k) const { return p[k]; } };
"""


class Param:
    def __init__(self, text: str, is_input: bool):
        words = text.split()
        self.raw = words[0] == "raw"
        self.type, self.name = words[-2], words[-1]
        self.is_input = is_input
        # our kernels' convention: a*, y are broadcast arrays; other non-raw params are scalars
        self.array = self.raw or re.fullmatch(r"a\d+|y", self.name) is not None

    @property
    def ctype(self) -> str:
        return _CT[self.type]


def kernel_params(in_params: str, out_params: str) -> list[Param]:
    return ([Param(p, True) for p in in_params.split(",") if p.strip()]
            + [Param(p, False) for p in out_params.split(",") if p.strip()])


def _offsets(arrays: list[Param], flat: str) -> str:
    n = max(len(arrays), 1)
    return (f"long long off[{n}] = {{0}}; {{ long long q = {flat}; "
            "for (int d = ndim - 1; d >= 0; --d) { long long ix = q % shape[d]; q /= shape[d]; "
            f"for (int k = 0; k < {len(arrays)}; ++k) off[k] += ix * strides[k * ndim + d]; }} }}")


def _bind(params: list[Param], arrays: list[Param]) -> str:
    lines, s = [], 0
    for p in params:
        if not p.array:
            lines.append(f"const {p.ctype} {p.name} = ({p.ctype})sc[{s}];")
            s += 1
            continue
        k = arrays.index(p)
        if p.raw:
            const = "const " if p.is_input else ""
            lines.append(f"RawArr<{const}{p.ctype}> {p.name}{{({const}{p.ctype}*)A[{k}]}};")
    return "\n".join(lines)


def _refs(arrays: list[Param], outputs: bool) -> str:
    out = []
    for k, p in enumerate(arrays):
        if p.raw or (not p.is_input) != outputs:
            continue
        const = "const " if p.is_input else ""
        out.append(f"{const}{p.ctype} &{p.name} = *({const}{p.ctype}*)(A[{k}] + off[{k}]);")
    return " ".join(out)


def _host_source(src) -> str:
    ns = f"ns_{src.name}"
    head = f"namespace {ns} {{\n{src.preamble}\n}}\n"
    sig = (f'extern "C" void {src.name}(void** A_, const long long* shape, '
           "const long long* strides, int ndim, long long size, int nout, const long long* sc)")
    if isinstance(src, cuda_source.ElementwiseSource):
        params = kernel_params(src.in_params, src.out_params)
        arrays = [p for p in params if p.array]
        return head + f"""{sig} {{
  using namespace {ns};
  char** A = (char**)A_; (void)nout;
  {_bind(params, arrays)}
  for (long long i = 0; i < size; ++i) {{
    {_offsets(arrays, "i")}
    {_refs(arrays, False)} {_refs(arrays, True)}
    {src.operation};
  }}
}}
"""
    params = kernel_params(src.in_params, src.out_params)
    arrays = [p for p in params if p.array]
    return head + f"""#define REDUCE(a, b) ({src.reduce_expr})
#define POST_MAP(a) ({src.post_map_expr})
{sig} {{
  using namespace {ns};
  typedef {src.reduce_type} _type_reduce;
  char** A = (char**)A_;
  {_bind(params, arrays)}
  long long outsize = 1, redsize = 1;
  for (int d = 0; d < ndim; ++d) {{ if (d < nout) outsize *= shape[d]; else redsize *= shape[d]; }}
  for (long long o = 0; o < outsize; ++o) {{
    _type_reduce _s = _type_reduce({src.identity});
    for (long long r = 0; r < redsize; ++r) {{
      {_offsets(arrays, "o * redsize + r")}
      {_refs(arrays, False)}
      _type_reduce _a = static_cast<_type_reduce>({src.map_expr});
      _s = REDUCE(_s, _a);
    }}
    {{ {_offsets(arrays, "o * redsize")}
      {_refs(arrays, True)}
      POST_MAP(_s); }}
  }}
}}
#undef REDUCE
#undef POST_MAP
"""


class HostKernels:
    """Generated kernels compiled for the host by g++, in batches, loaded with ctypes. Safe to
    use from several threads (CuPy's compile is: two backends of a pipeline's ranks open at
    once): a build takes every pending source under a lock, and a name asked for while another
    thread builds it waits for that build."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.pending: dict = {}
        self.functions: dict = {}
        self.lock = threading.RLock()

    def add(self, src) -> None:
        with self.lock:
            if src.name not in self.functions:
                self.pending[src.name] = src

    def function(self, name: str):
        with self.lock:
            if name not in self.functions:
                self.build()
            return self.functions[name]

    def build(self) -> None:
        with self.lock:
            self._build()

    def _build(self) -> None:
        sources = list(self.pending.values())
        self.pending = {}
        if not sources:
            return
        text = _HOST_HEADER + "\n".join(_host_source(s) for s in sources)
        digest = hashlib.sha1(text.encode()).hexdigest()[:16]
        lib = self.directory / f"k_{digest}.so"
        if not lib.exists():
            cpp = self.directory / f"k_{digest}.cpp"
            cpp.write_text(text)
            result = subprocess.run([CXX, "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-w",
                                     "-o", str(lib), str(cpp)], capture_output=True, text=True)
            assert result.returncode == 0, result.stderr[-4000:]
        dll = ctypes.CDLL(str(lib))
        for s in sources:
            fn = getattr(dll, s.name)
            fn.restype = None
            self.functions[s.name] = fn


def _call(fn, arrays, shape, strides, scalars, nout=0):
    ptrs = (ctypes.c_void_p * max(len(arrays), 1))(*[a.ctypes.data for a in arrays])
    shp = np.asarray(shape, np.int64)
    std = np.asarray(strides, np.int64).reshape(-1)
    sc = np.asarray(list(scalars) or [0], np.int64)
    size = int(np.prod(shape)) if len(shape) else 1
    fn(ptrs, shp.ctypes.data_as(ctypes.c_void_p), std.ctypes.data_as(ctypes.c_void_p),
       ctypes.c_int(len(shape)), ctypes.c_longlong(size), ctypes.c_int(nout),
       sc.ctypes.data_as(ctypes.c_void_p))
