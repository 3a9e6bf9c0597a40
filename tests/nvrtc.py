"""NVRTC through ctypes, and the CUDA C++ modules CuPy v14 builds around each generated kernel, so
that a CPU-only test compiles every kernel the CuPy backend can run for a real GPU architecture
(`tests/test_nvrtc.py`). No GPU, driver, CUDA toolkit or CuPy is needed: the `test` extra installs
PyPI's `nvidia-cuda-nvrtc` wheel (13.3 or newer: `libnvrtc.so.13` in `site-packages/nvidia/cu13/
lib`, and the CUDA headers it bundles, `cuda_fp16.h` among them, which `nvrtcInstallBundledHeaders`
writes into a directory; before 13.3 the `nvidia-cuda-runtime` wheel's headers would serve).

The modules are a replica of CuPy's own text (`cupy/_core/_kernel.pyx`:
`_get_simple_elementwise_kernel_code`, `_get_elementwise_kernel_code`; `_reduction.pyx`:
`_create_reduction_function_code`, `_ReductionKernel_get_cached_function_code`; `core.pyx`: the
headers it prepends): each array parameter a `CArray<T, ndim, c_contiguous, use_32bit_indexing>`
named `_raw_<name>` and bound by reference to `_raw_<name>[_ind.get()]` (a reduction's inputs by
value), `raw` parameters passed as they are, scalars `const` values, a `CIndexer` over the
launch, float16 through `#include "cupy/float16.cuh"`. The `cupy/*.cuh` headers are the stand-ins
below, given to NVRTC by name: the parts of CuPy's `carray.cuh` and `float16.cuh` the generated
code uses, with CuPy's semantics (`float16` wraps `cuda_fp16.h`'s `half`: implicit from float,
explicit from other types, `operator float`, assignment through `static_cast`). Where the real
CuPy is installed (the `cupy-check` extra), `cupy_module` has CuPy's own generators write the
modules and `cupy_compile_options` gives its own options and headers: the test checks the
replica against them, token for token, and compiles both.

Options are what CuPy passes: the kernel's own (`cuda_source.NVRTC_OPTIONS`), the ones CuPy adds to
every NVRTC compile (`CUPY_ADDED_OPTIONS`, from `cupy/cuda/compiler.py`) and `-arch=sm_90`
(CuPy's `-arch=sm_<cc>`: a cubin, real SASS, checked to contain every kernel by name).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cupy_headers import CUPY_HEADER, STANDIN_HEADERS

#: the architecture the kernels are compiled for (H100); NVRTC makes a cubin for it
ARCH = "sm_90"
#: what CuPy v14 appends to every NVRTC compile (`_compile_with_cache_cuda`,
#: `_compile_using_nvrtc_no_warning`): flush denormals to zero, and functions without an
#: execution space are device functions
CUPY_ADDED_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
#: threads per block of CuPy's simple reduction (`_get_block_specs`: 512 by default)
REDUCE_BLOCK = 512

# ---------------------------------------------------------------------- the library


class NvrtcError(RuntimeError):
    """A failed NVRTC call; for a compilation, `log` holds NVRTC's messages."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message + (f"\n{log}" if log else ""))
        self.log = log


def _site_dirs() -> list[Path]:
    """Directories of the `nvidia` namespace package (the NVIDIA wheels), without importing
    anything heavy."""
    dirs = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs += [Path(p) for p in spec.submodule_search_locations]
    for p in sys.path:  # a namespace package may be split; find_spec lists every part
        d = Path(p) / "nvidia"
        if d.is_dir() and d not in dirs:
            dirs.append(d)
    return dirs


def library_candidates() -> list[Path]:
    """Where libnvrtc may be, best first: the PyPI wheels (`nvidia/cu13/lib` from CUDA 13,
    `nvidia/cuda_nvrtc/lib` before), `$CUDA_PATH` / `$CUDA_HOME`, then the loader's search."""
    found: list[Path] = []
    for d in _site_dirs():
        for pattern in ("cu*/lib/libnvrtc.so.*", "cuda_nvrtc/lib/libnvrtc.so.*"):
            found += sorted((Path(p) for p in glob.glob(str(d / pattern))), reverse=True)
    for var in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(var)
        if root:
            found += sorted(Path(root).glob("lib*/libnvrtc.so*"), reverse=True)
    name = ctypes.util.find_library("nvrtc")
    if name:
        found.append(Path(name))
    # the builtins library matches no pattern above (libnvrtc-builtins.so.*)
    return [p for p in found if p.name.startswith("libnvrtc.so")]


class Nvrtc:
    """libnvrtc loaded with ctypes: `version`, `archs`, `headers(dir)`, `compile(...)`."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        lib = self.lib = ctypes.CDLL(str(path))
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)
        count = ctypes.c_int()
        self._check(lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "archs")
        archs = (ctypes.c_int * count.value)()
        self._check(lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
        self.archs = tuple(archs)

    def _check(self, status: int, what: str, log: str = "") -> None:
        if status != 0:
            text = self.lib.nvrtcGetErrorString(status).decode()
            raise NvrtcError(f"{what}: {text} ({status})", log)

    @property
    def bundles_headers(self) -> bool:
        """Whether this NVRTC carries the CUDA headers (`nvrtcInstallBundledHeaders`, 13.3+)."""
        return hasattr(self.lib, "nvrtcInstallBundledHeaders")

    def install_headers(self, directory: Path) -> Path:
        """The bundled CUDA headers written into `directory` (skipped when already there)."""
        error = ctypes.c_char_p()
        fn = self.lib.nvrtcInstallBundledHeaders
        fn.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_char_p)]
        status = fn(str(directory).encode(), 0, ctypes.byref(error))
        self._check(status, "nvrtcInstallBundledHeaders",
                    (error.value or b"").decode(errors="replace"))
        return directory

    def compile(self, source: str, options: tuple[str, ...], name: str = "kernels.cu",
                headers: dict[str, str] | None = None, output: str = "cubin") -> bytes:
        """The cubin of `source` (with `-arch=sm_XX` among `options`), or with `output="ptx"`
        its PTX; raises `NvrtcError` with NVRTC's log when it does not compile. `headers`:
        sources NVRTC finds by include name before searching the `-I` directories."""
        lib = self.lib
        prog = ctypes.c_void_p()
        headers = headers or {}
        n = len(headers)
        hsrc = (ctypes.c_char_p * max(n, 1))(*[v.encode() for v in headers.values()])
        hname = (ctypes.c_char_p * max(n, 1))(*[k.encode() for k in headers])
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                           n, hsrc if n else None, hname if n else None),
                    "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "log size")
            log = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetProgramLog(prog, log), "log")
            self._check(status, f"nvrtcCompileProgram({name})",
                        log.value.decode(errors="replace"))
            if output == "ptx":
                self._check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
                ptx = ctypes.create_string_buffer(size.value)
                self._check(lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
                return ptx.value
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            if size.value == 0:
                raise NvrtcError(f"{name}: no cubin (options {options} name no real sm_ arch)")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def load() -> Nvrtc | None:
    """The first libnvrtc that loads, or None."""
    for path in library_candidates():
        try:
            return Nvrtc(path)
        except (OSError, AttributeError, NvrtcError):
            continue
    return None


def cuda_include_dirs(nv: Nvrtc, scratch: Path) -> list[Path]:
    """Directories holding `cuda_fp16.h` for NVRTC: its bundled headers (written under
    `scratch`), else the `nvidia-cuda-runtime` wheel's include directory, else
    `$CUDA_PATH/include`. Empty where none is found."""
    if nv.bundles_headers:
        return [nv.install_headers(scratch / f"nvrtc-{nv.version[0]}.{nv.version[1]}-headers")]
    dirs = [Path(p).parent for d in _site_dirs()
            for p in glob.glob(str(d / "*" / "include" / "cuda_fp16.h"))]
    for var in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(var)
        if root and (Path(root) / "include" / "cuda_fp16.h").exists():
            dirs.append(Path(root) / "include")
    return dirs[:1]


# ---------------------------------------------------------------------- CuPy's kernel text

#: CuPy's C type of each dtype name a parameter may take (`_scalar.pyx`, `_typenames_base`)
_CTYPE = {"float16": "float16", "float32": "float", "float64": "double", "int64": "long long",
          "int32": "int", "int16": "short", "int8": "signed char", "uint64": "unsigned long long",
          "uint32": "unsigned int", "uint16": "unsigned short", "uint8": "unsigned char",
          "bool": "bool"}
#: the type declaration a parameter's dtype brings (`_typenames_base`: only float16 here)
_DECL = {"float16": '#include "cupy/float16.cuh"'}


@dataclass(frozen=True)
class Param:
    """One parameter as CuPy's `ParameterInfo` reads it, and how it is passed: `array` (a
    `cupy.ndarray` argument) or a scalar."""
    name: str
    dtype: str
    raw: bool
    is_const: bool
    array: bool

    @property
    def ctype(self) -> str:
        return _CTYPE[self.dtype]


def parse_params(text: str, is_const: bool) -> list[Param]:
    """CuPy's `_get_param_info`: comma-separated `[raw] dtype name`; `array` is left False."""
    out = []
    for part in text.split(","):
        words = part.split()
        if not words:
            continue
        if len(words) < 2:
            raise ValueError(f"syntax error in parameter {part!r}")
        dtype, name = words[-2:]
        for w in words[:-2]:
            if w not in ("raw", "_non_const"):
                raise ValueError(f"unknown keyword {w!r} in parameter {part!r}")
        if dtype not in _CTYPE:
            raise ValueError(f"parameter {part!r}: dtype {dtype!r} has no CuPy C type here")
        out.append(Param(name, dtype, "raw" in words[:-2],
                         is_const and "_non_const" not in words[:-2], False))
    return out


@dataclass(frozen=True)
class Layout:
    """How the non-raw array arguments reach the kernel after CuPy's `reduce_dims`: `ndim`
    (for a reduction: the input's; its output has `out_ndim`), C-contiguity and 32-bit indexing.
    Raw arrays are 1-d, contiguous, as the backend passes them."""
    name: str
    ndim: int
    out_ndim: int
    c_contiguous: bool
    index_32: bool


#: every array contiguous (CuPy collapses them to 1-d), and strided views of 3 dims
LAYOUTS = (Layout("contiguous", 1, 1, True, True), Layout("strided", 3, 2, False, False))


def _carray(p: Param, ndim: int, layout: Layout) -> str:
    if p.raw:
        return f"CArray<{p.ctype}, 1, 1, {int(layout.index_32)}>"
    return f"CArray<{p.ctype}, {ndim}, {int(layout.c_contiguous)}, {int(layout.index_32)}>"


def _kernel_params(params: list[Param], layout: Layout, ndims: list[int], decls: set) -> str:
    """CuPy's `_get_kernel_params` (`const` where the parameter is, `_raw_` before the name of
    a non-raw array)."""
    items = []
    for p, ndim in zip(params, ndims):
        if p.dtype in _DECL:
            decls.add(_DECL[p.dtype])
        ctype = _carray(p, ndim, layout) if p.array else p.ctype
        name = f"_raw_{p.name}" if p.array and not p.raw else p.name
        items.append(f"{'const ' if p.is_const else ''}{ctype} {name}")
    return ", ".join(items)


def _mark_arrays(src, n_array_inputs: int) -> tuple[list[Param], list[Param]]:
    ins = parse_params(src.in_params, True)
    outs = parse_params(src.out_params, False)
    ins = [Param(p.name, p.dtype, p.raw, p.is_const, p.raw or k < n_array_inputs)
           for k, p in enumerate(ins)]
    outs = [Param(p.name, p.dtype, p.raw, p.is_const, True) for p in outs]
    return ins, outs


def elementwise_module(src, n_array_inputs: int, layout: Layout, name: str) -> tuple[set, str]:
    """(type declarations, module text) of `cupy.ElementwiseKernel(src.in_params,
    src.out_params, src.operation, name, preamble=src.preamble)` called with its first
    `n_array_inputs` inputs as arrays (the rest scalars) and every output an array."""
    ins, outs = _mark_arrays(src, n_array_inputs)
    params = ins + outs
    decls: set = set()
    ndims = [layout.ndim] * len(params)
    sig = _kernel_params(params, layout, ndims, decls)
    sig += f", CIndexer<{layout.ndim}, {int(layout.index_32)}> _ind"
    refs = []
    for p in params:
        if p.array and not p.raw:
            refs.append(f"{'const ' if p.is_const else ''}{p.ctype} &{p.name} = "
                        f"_raw_{p.name}[_ind.get()];")
    operation = "\n".join(refs + [src.operation])
    code = f"""
    {''.join(d + chr(10) for d in sorted(decls))}
    {src.preamble}
    extern "C" __global__ void {name}({sig}) {{
      ;
      #pragma unroll 1
      CUPY_FOR(i, _ind.size()) {{
        _ind.set(i);
        {operation};
      }}
      ;
    }}
    """
    return decls, code


def reduction_module(src, n_array_inputs: int, layout: Layout, name: str) -> tuple[set, str]:
    """(type declarations, module text) of `cupy.ReductionKernel(...)` of `src` called with its
    first `n_array_inputs` inputs as arrays and `out=` an array, without CUB."""
    ins, outs = _mark_arrays(src, n_array_inputs)
    params = ins + outs
    decls: set = set()
    ndims = [layout.ndim] * len(ins) + [layout.out_ndim] * len(outs)
    sig = _kernel_params(params, layout, ndims, decls)
    sig += (f", CIndexer<{layout.ndim}, {int(layout.index_32)}> _in_ind"
            f", CIndexer<{layout.out_ndim}, {int(layout.index_32)}> _out_ind"
            ", const int _block_stride")
    index_t = "int" if layout.index_32 else "long long"
    input_expr = "\n".join(
        (f"const {p.ctype} {p.name}" if p.is_const else f"{p.ctype}& {p.name}")
        + f" = _raw_{p.name}[_in_ind.get()];" for p in ins if p.array and not p.raw)
    output_expr = "\n".join(f"{p.ctype} &{p.name} = _raw_{p.name}[_out_ind.get()];"
                            for p in outs if not p.raw and not p.is_const)
    b = REDUCE_BLOCK
    code = f"""
{''.join(d + chr(10) for d in sorted(decls))}typedef {index_t} IndexT;

{src.preamble}
#define REDUCE(a, b) ({src.reduce_expr})
#define POST_MAP(a) ({src.post_map_expr})
#define _REDUCE(_offset) if (_tid < _offset) {{   _type_reduce _a = _sdata[_tid], \
_b = _sdata[(_tid + _offset)];   _sdata[_tid] = REDUCE(_a, _b); }}

typedef {src.reduce_type} _type_reduce;
extern "C" __global__ void {name}({sig}) {{
  __shared__ char _sdata_raw[{b} * sizeof(_type_reduce)];
  _type_reduce *_sdata = reinterpret_cast<_type_reduce*>(_sdata_raw);
  unsigned int _tid = threadIdx.x;

  IndexT _J_offset = _tid >> __popc(_block_stride - 1); // _tid / _block_stride
  ptrdiff_t _j_offset = (ptrdiff_t)_J_offset * _out_ind.size();
  IndexT _J_stride = {b} >> __popc(_block_stride - 1);
  ptrdiff_t _j_stride = (ptrdiff_t)_J_stride * _out_ind.size();

  for (ptrdiff_t _i_base = (ptrdiff_t)blockIdx.x * _block_stride;
       _i_base < _out_ind.size();
       _i_base += (ptrdiff_t)gridDim.x * _block_stride) {{
    _type_reduce _s = _type_reduce({src.identity});
    ptrdiff_t _i =
        _i_base + (_tid & (_block_stride - 1));  // _tid % _block_stride
    IndexT _J = _J_offset;
    for (ptrdiff_t _j = _i + _j_offset; _j < _in_ind.size();
         _j += _j_stride, _J += _J_stride) {{
      _in_ind.set(_j);
      {input_expr}
      _type_reduce _a = static_cast<_type_reduce>({src.map_expr});
      _s = REDUCE(_s, _a);
    }}
    _sdata[_tid] = _s;
    __syncthreads();
    for (unsigned int _block = {b} / 2;
         _block >= _block_stride; _block >>= 1) {{
      if (_tid < _block) {{
        _REDUCE(_block);
      }}
      __syncthreads();
    }}
    if (_tid < _block_stride) {{
      _s = _sdata[_tid];
    }}
    if (_tid < _block_stride && _i < _out_ind.size()) {{
      _out_ind.set(static_cast<ptrdiff_t>(_i));
      {output_expr}
      POST_MAP(_s);
    }}
  }}
}}"""
    return decls, code


def replica_module(src, n_arrays: int, layout: Layout, name: str) -> tuple[set, str]:
    """(type declarations, text) of the module CuPy makes of `src`, by the replica above."""
    from einpage.runtime.backends.cuda_source import ElementwiseSource
    make = elementwise_module if isinstance(src, ElementwiseSource) else reduction_module
    return make(src, n_arrays, layout, name)


def kernel_program(kernels, layouts=LAYOUTS, module=replica_module) -> tuple[str, list[str]]:
    """One translation unit for `kernels` (`(source, n_array_inputs)` pairs): CuPy's header
    and the type declarations once, then each kernel's module (made by `module`) for each
    layout inside a namespace of its own (each module repeats our preamble's functions, as each
    CuPy module has them). Returns the text and the kernel (function) names it defines."""
    decls: set = set()
    parts, names = [], []
    for src, n_arrays in kernels:
        for layout in layouts:
            name = f"{src.name}__{layout.name}"
            d, code = module(src, n_arrays, layout, name)
            decls |= d
            parts.append(f"namespace ns_{name} {{\n{code}\n}}  // namespace ns_{name}\n"
                         "#undef REDUCE\n#undef POST_MAP\n#undef _REDUCE\n")
            names.append(name)
    head = CUPY_HEADER + "".join(d + "\n" for d in sorted(decls))
    return head + "\n".join(parts), names



# ---------------------------------------------------------------------- the real CuPy's text

def real_cupy():
    """The installed CuPy module, or None (it imports without a GPU or driver)."""
    if importlib.util.find_spec("cupy") is None:
        return None
    import cupy
    return cupy


def cupy_module(src, n_arrays: int, layout: Layout, name: str) -> tuple[set, str]:
    """(type declarations, text) of the module the installed CuPy itself makes of `src`, by its
    own code generators (`_kernel._get_elementwise_kernel_code`,
    `_reduction._ReductionKernel_get_cached_function_code`) fed the argument descriptions a call
    would give them (`_ArgInfo`, rebuilt through its pickle support: it has no constructor).
    Internal CuPy API, for the `cupy-check` extra only."""
    import cupy
    import numpy
    from cupy._core import _carray, _kernel, _reduction, _scalar

    from einpage.runtime.backends.cuda_source import ElementwiseSource
    argc = _kernel._ArgInfo
    unpickle, (_, checksum, _) = argc.__new__(argc).__reduce__()

    def info(kind, typ, dtype, ndim, contiguous, index_32):
        # fields in Cython's pickle order: arg_kind, c_contiguous, dtype, index_32_bits, ndim, type
        return unpickle(argc, checksum, (kind, contiguous, dtype, index_32, ndim, typ))

    ndarray, indexer, scalar = 1, 2, 3  # _kernel.pxd: ARG_KIND_NDARRAY, _INDEXER, _SCALAR
    ins, outs = _mark_arrays(src, n_arrays)
    elementwise = isinstance(src, ElementwiseSource)
    if elementwise:
        kernel = cupy.ElementwiseKernel(src.in_params, src.out_params, src.operation, name=name,
                                        preamble=src.preamble, no_return=True)
        params = kernel.params
    else:
        kernel = cupy.ReductionKernel(src.in_params, src.out_params, src.map_expr,
                                      src.reduce_expr, src.post_map_expr, src.identity,
                                      name=name, reduce_type=src.reduce_type,
                                      preamble=src.preamble)
        params = kernel._params
    infos = []
    for k, p in enumerate(params):
        ours = (ins + outs)[k] if k < len(ins) + len(outs) else None
        if p.name in ("_ind", "_in_ind", "_out_ind"):
            ndim = layout.out_ndim if p.name == "_out_ind" else layout.ndim
            infos.append(info(indexer, _carray.Indexer, None, ndim, True, layout.index_32))
        elif ours is not None and ours.array:
            ndim = 1 if p.raw else (layout.ndim if elementwise or k < len(ins)
                                    else layout.out_ndim)
            contiguous = True if p.raw else layout.c_contiguous
            infos.append(info(ndarray, cupy.ndarray, numpy.dtype(p.dtype), ndim, contiguous,
                              layout.index_32))
        else:
            infos.append(info(scalar, _scalar.CScalar, numpy.dtype(p.dtype), 0, True, True))
    infos = tuple(infos)
    if elementwise:
        code = _kernel._get_elementwise_kernel_code(infos, _kernel._TypeMap(()), params,
                                                    kernel.operation, name, kernel.preamble)
    else:
        index = ("IndexT", "int32" if layout.index_32 else "int64")
        code = _reduction._ReductionKernel_get_cached_function_code(
            kernel.nin, kernel.nout, params, infos, _kernel._TypeMap((index,)), name,
            REDUCE_BLOCK, kernel.reduce_type, kernel.identity, kernel.map_expr,
            kernel.reduce_expr, kernel.post_map_expr, kernel.preamble, ())
    decls = {d for p in ins + outs if p.dtype in _DECL for d in [_DECL[p.dtype]]}
    return decls, code


def cupy_compile_options(options: tuple[str, ...]) -> tuple[str, ...]:
    """What the installed CuPy passes NVRTC for a kernel with `options`, before the
    architecture: its `assemble_cupy_compiler_options` (its CCCL and own headers, the CUDA
    headers it finds: the nvidia-cuda-runtime wheel's or a toolkit's) and `-ftz=true`."""
    from cupy._core import core
    return tuple(core.assemble_cupy_compiler_options(tuple(options))) + ("-ftz=true",)


# ---------------------------------------------------------------------- the kernels to compile

def _families():
    from dataclasses import replace

    from einpage.models.config import RopeScaling, preset
    tiny = preset("tiny")
    return {
        "llama": replace(tiny, name="tiny-llama3", family="llama",
                         rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16)),
        "mistral": replace(tiny, name="tiny-mistral", family="mistral", sliding_window=3),
        "qwen2": replace(tiny, name="tiny-qwen2", family="qwen2", qkv_bias=True, tied=True),
        "qwen3": replace(tiny, name="tiny-qwen3", family="qwen3", qk_norm=True, head_dim=12),
        "mixtral": replace(tiny, name="tiny-mixtral", family="mixtral", experts=4,
                           experts_per_token=2, sliding_window=4),
    }


#: a tiny model of each family, with what makes the family differ from LLaMA: llama3 rope
#: scaling, a sliding window, q/k/v biases and tied embeddings, q/k norm (and another head
#: size), a mixture of experts (with a window too)
FAMILIES = _families()
#: bytes of "device" of every plan: all of them page, and split reductions into partials
BUDGET = 40_000


def family_plans(cfg) -> list:
    """Prefill and decode memgraphs of `cfg` in f32, bf16 and f16 under `BUDGET`."""
    from einpage.compiler import CompileOptions, compile_graph
    from einpage.ir.dtypes import DType
    from einpage.models import llama
    plans = []
    for dtype in (DType.f32, DType.bf16, DType.f16):
        c = cfg.with_dtype(dtype)
        for graph in (llama.prefill_graph(c).bind(B=2, S=5),
                      llama.decode_graph(c).bind(B=2, C=4)):
            plans.append(compile_graph(graph, CompileOptions(BUDGET)).memgraph)
    return plans


@functools.lru_cache(maxsize=None)
def family_kernels() -> dict:
    """`{family: kernels_of(family_plans(cfg))}` for `FAMILIES`, made once per process."""
    return {name: kernels_of(family_plans(cfg)) for name, cfg in FAMILIES.items()}


def kernels_of(mgs) -> dict:
    """`{(name, arrays): (source, arrays)}`: every kernel the plans run
    (`apply_plan.plan_kernels`), with how many of its inputs the backend passes as arrays (a
    `KernelApply`'s views, before its scalars; the kernels of GEMM and copy applies take arrays
    only)."""
    from einpage.runtime.backends.apply_plan import KernelApply, plan_applies, plan_kernels
    found = {}
    for mg in mgs:
        for plan in plan_applies(mg).values():
            for src in plan_kernels(plan):
                n = (len(plan.arrays) if isinstance(plan, KernelApply)
                     else len(parse_params(src.in_params, True)))
                found[(src.name, n)] = (src, n)
    return found


__all__ = ["ARCH", "BUDGET", "CUPY_ADDED_OPTIONS", "CUPY_HEADER", "FAMILIES", "LAYOUTS",
           "Layout", "Nvrtc", "NvrtcError", "Param", "STANDIN_HEADERS", "cuda_include_dirs",
           "cupy_compile_options", "cupy_module", "elementwise_module",
           "family_kernels", "family_plans", "kernel_program", "kernels_of",
           "library_candidates", "load", "parse_params", "real_cupy", "reduction_module",
           "replica_module"]
