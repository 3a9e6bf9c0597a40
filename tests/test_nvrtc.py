"""Every kernel the CuPy backend can generate for the five model families compiles for the
device (sm_90, a real cubin) with NVRTC, on any machine: no GPU, driver or CUDA toolkit.

NVRTC is PyPI's `nvidia-cuda-nvrtc` wheel of the `test` extra, loaded with ctypes
(`tests/nvrtc.py`), with the CUDA headers it bundles. Each kernel is wrapped as CuPy v14 wraps an
`ElementwiseKernel` / `ReductionKernel` (its module text, its `CArray` / `CIndexer` parameters, the
`float16` class, the reduction's `_type_reduce`, `REDUCE` / `POST_MAP` macros), for two argument
layouts (contiguous 1-d with 32-bit indexing; strided 3-d with 64-bit), and compiled with the
backend's `NVRTC_OPTIONS` plus what CuPy adds, all in one program. The kernels are those of every
plan (`apply_plan.plan_kernels`) of tiny LLaMA-3 (llama3 rope scaling), Mistral (sliding window),
Qwen2 (q/k/v biases, tied embeddings), Qwen3 (q/k norm) and Mixtral (experts) models in f32, bf16
and f16, prefill and decode, paged under a small budget, and every dequantization kernel of a
packed (quantized) read (each storage format, k-quants included, to f32, f16 and bf16) and of
a gather of a packed table (the same, written as f32, f16 and bf16, or summed into them). The PTX
of one join shows what `--fmad=false` and CuPy's `-ftz=true` do to it.

In CI (`$CI` set) a missing NVRTC fails the test; elsewhere it skips ("no CUDA compiler ...").
With the real CuPy installed (the `cupy-check` extra) the modules are also written by CuPy's own
generators and compiled with its headers and options, and the replica is checked against them.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import replace

import nvrtc
import pytest

from einpage.ir import scalar
from einpage.runtime.backends.cuda_source import NVRTC_OPTIONS, join_kernel


def _missing(why: str):
    if os.environ.get("CI"):
        pytest.fail(f"{why}: CI compiles every generated kernel with NVRTC (the `test` extra "
                    "installs nvidia-cuda-nvrtc)", pytrace=False)
    pytest.skip(f"no CUDA compiler: {why} (pip install -e '.[test]' installs NVRTC)")


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    """(NVRTC, the CUDA include directory) or skip / fail."""
    nv = nvrtc.load()
    if nv is None:
        _missing("NVRTC (libnvrtc) not found")
    arch = int(nvrtc.ARCH.removeprefix("sm_"))
    if arch not in nv.archs:
        _missing(f"NVRTC {nv.version} at {nv.path} cannot target {nvrtc.ARCH} ({nv.archs})")
    dirs = nvrtc.cuda_include_dirs(nv, tmp_path_factory.mktemp("cuda-headers"))
    if not dirs:
        _missing(f"NVRTC {nv.version} bundles no CUDA headers and no cuda_fp16.h was found")
    return nv, dirs[0]


@pytest.fixture(scope="module")
def family_kernels():
    return nvrtc.family_kernels()


def _options(include) -> tuple[str, ...]:
    """The backend's options, what CuPy adds, the architecture, the CUDA headers."""
    return (tuple(NVRTC_OPTIONS) + nvrtc.CUPY_ADDED_OPTIONS
            + (f"-arch={nvrtc.ARCH}", f"-I{include}"))


def _real_cupy():
    cupy = nvrtc.real_cupy()
    if cupy is None:
        pytest.skip("no GPU: the real CuPy is the optional extra cupy-check (its headers and "
                    "code generators are what this variant compiles)")
    return cupy


@pytest.fixture(scope="module")
def real_cupy():
    return _real_cupy()


def _compile(nv, mode: str, include, kernels):
    """(kernel names, cubin, seconds) of one program of `kernels`: `standin` wraps them with
    the replica of CuPy's text and the stand-in headers, with `_options`; `cupy` with the
    installed CuPy's own code generators, headers and options (as it compiles at run time)."""
    if mode == "standin":
        text, names = nvrtc.kernel_program(kernels)
        options, headers = _options(include), nvrtc.STANDIN_HEADERS
    else:
        _real_cupy()
        text, names = nvrtc.kernel_program(kernels, module=nvrtc.cupy_module)
        options = (nvrtc.cupy_compile_options(tuple(NVRTC_OPTIONS))
                   + (f"-arch={nvrtc.ARCH}", "--device-as-default-execution-space"))
        headers = {}
    start = time.perf_counter()
    try:
        cubin = nv.compile(text, options, headers=headers)
    except nvrtc.NvrtcError as exc:
        pytest.fail(f"NVRTC {nv.version} rejects the generated kernels ({mode}):\n"
                    + _excerpt(exc.log or str(exc), text), pytrace=False)
    return names, cubin, time.perf_counter() - start


def _excerpt(log: str, text: str) -> str:
    """NVRTC's log with the source lines it names."""
    lines = text.splitlines()
    out = [log[-6000:]]
    for m in list(re.finditer(r"\((\d+)\): error", log))[:5]:
        k = int(m.group(1))
        out.append(f"--- kernels.cu:{k}\n" + "\n".join(lines[max(0, k - 4):k + 1]))
    return "\n".join(out)


@pytest.mark.parametrize("mode", ["standin", "cupy"])
def test_every_kernel_compiles_for_sm_90(compiler, family_kernels, mode, record_property):
    """One NVRTC program holds every distinct kernel of every family, in each layout; its cubin
    defines each by name. Prints the kernels per family and the compile time."""
    nv, include = compiler
    every = {}
    for name, found in family_kernels.items():
        assert len(found) >= 30, (name, len(found))  # the plans do page and split
        every.update(found)
    names, cubin, seconds = _compile(nv, mode, include, list(every.values()))
    assert cubin[:4] == b"\x7fELF"
    missing = [n for n in names if n.encode() not in cubin]
    assert not missing, f"kernels missing from the cubin: {missing[:5]}"
    counts = {name: len(found) for name, found in family_kernels.items()}
    summary = (f"NVRTC {nv.version[0]}.{nv.version[1]} {nvrtc.ARCH} ({mode}): "
               + ", ".join(f"{k} {v}" for k, v in counts.items())
               + f" kernels; {len(every)} distinct x {len(nvrtc.LAYOUTS)} layouts = "
               f"{len(names)} compiled in {seconds:.2f} s, cubin {len(cubin)} bytes")
    record_property("nvrtc", summary)
    print(summary)


def dequant_kernels() -> list:
    """Every dequantization kernel (`cuda_source.dequant_kernel`): each storage format (the
    k-quants GGUF files hold included) to each logical dtype, with its one (raw) array input."""
    from einpage.ir.storage import FORMATS
    from einpage.runtime.backends.cuda_source import dequant_kernel
    return [(dequant_kernel(fmt, tag), 1) for fmt in FORMATS for tag in ("f32", "f16", "bf16")]


def dequant_gather_kernels(every: bool = True) -> list:
    """The gathers of a packed table (`cuda_source.dequant_gather_kernel`), with their two (raw)
    array inputs (the packed bytes and the ids) before their scalars: every storage format x
    logical table dtype x write dtype x writing or summing, or (`every` off) each format once,
    the dtypes and the accumulation taken in turn so that each appears."""
    from einpage.ir.storage import FORMATS
    from einpage.runtime.backends.cuda_source import dequant_gather_kernel
    tags = ("f32", "f16", "bf16")
    if not every:
        return [(dequant_gather_kernel(fmt, tags[(k + 1) % 3], tags[k % 3],
                                       (None, "sum")[k % 2]), 2)
                for k, fmt in enumerate(FORMATS)]
    return [(dequant_gather_kernel(fmt, out, tag, combine), 2) for fmt in FORMATS
            for tag in tags for out in tags for combine in (None, "sum")]


def _compiles(compiler, mode, kernels, what: str, key: str, record_property) -> None:
    """`kernels` in one NVRTC program for sm_90; the cubin defines each by name."""
    nv, include = compiler
    count = len(kernels)
    assert len({src.name for src, _ in kernels}) == count
    names, cubin, seconds = _compile(nv, mode, include, kernels)
    assert cubin[:4] == b"\x7fELF" and len(names) == count * len(nvrtc.LAYOUTS)
    missing = [n for n in names if n.encode() not in cubin]
    assert not missing, f"kernels missing from the cubin: {missing[:5]}"
    summary = (f"NVRTC {nv.version[0]}.{nv.version[1]} {nvrtc.ARCH} ({mode}): {count} {what} "
               f"x {len(nvrtc.LAYOUTS)} layouts compiled in {seconds:.2f} s")
    record_property(key, summary)
    print(summary)


@pytest.mark.parametrize("mode", ["standin", "cupy"])
def test_each_dequant_gather_format_compiles_for_sm_90(compiler, mode, record_property):
    """A gather of a packed table (a quantized embedding) per format, dequantizing only the
    picked elements; every table dtype, write dtype and accumulation among them."""
    _compiles(compiler, mode, dequant_gather_kernels(every=False),
              "dequantizing gather kernels", "nvrtc_dequant_gather", record_property)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["standin", "cupy"])
def test_every_dequant_gather_kernel_compiles_for_sm_90(compiler, mode, record_property):
    """All 108 of them (about 7 s): `-m slow`."""
    from einpage.ir.storage import FORMATS
    kernels = dequant_gather_kernels()
    assert len(kernels) == len(FORMATS) * 3 * 3 * 2
    _compiles(compiler, mode, kernels, "dequantizing gather kernels",
              "nvrtc_dequant_gather_all", record_property)


@pytest.mark.parametrize("mode", ["standin", "cupy"])
def test_every_dequant_kernel_compiles_for_sm_90(compiler, mode, record_property):
    """The kernels that dequantize packed (quantized) weight blocks, every format to every
    logical dtype, in one NVRTC program."""
    kernels = dequant_kernels()
    assert len(kernels) == 18
    _compiles(compiler, mode, kernels, "dequantization kernels", "nvrtc_dequant",
              record_property)


def test_the_replica_is_the_text_cupy_generates(real_cupy, family_kernels):
    """The modules the stand-in variant compiles are, token for token, those the installed
    CuPy's own generators make of every kernel in every layout."""
    every = {k: v for found in family_kernels.values() for k, v in found.items()}
    every.update({(src.name, n): (src, n) for src, n in dequant_kernels()})
    every.update({(src.name, n): (src, n) for src, n in dequant_gather_kernels()})
    for src, n_arrays in every.values():
        for layout in nvrtc.LAYOUTS:
            name = f"{src.name}__{layout.name}"
            ours = nvrtc.replica_module(src, n_arrays, layout, name)
            theirs = nvrtc.cupy_module(src, n_arrays, layout, name)
            assert ours[0] == theirs[0], (name, ours[0], theirs[0])
            if ours[1].split() != theirs[1].split():
                a, b = ours[1].split(), theirs[1].split()
                k = next(i for i, (x, y) in enumerate(zip(a + [""], b + [""])) if x != y)
                pytest.fail(f"{name}: the replica differs from CuPy's text at token {k}: "
                            f"{' '.join(a[max(0, k - 12):k + 12])!r} vs "
                            f"{' '.join(b[max(0, k - 12):k + 12])!r}", pytrace=False)


def test_nvrtc_rejects_what_the_device_cannot_compile(compiler):
    """The harness is not vacuous: a kernel calling an undeclared function and one assigning to
    a const input are NVRTC errors."""
    nv, include = compiler
    src = join_kernel(scalar.x(0), ("f32",), "float", "f32")
    for operation in ("y = ep_undeclared(a0)", "a0 = y"):
        text, _ = nvrtc.kernel_program([(replace(src, operation=operation), 1)])
        with pytest.raises(nvrtc.NvrtcError, match="error"):
            nv.compile(text, _options(include), headers=nvrtc.STANDIN_HEADERS)


def test_options_are_nvrtc_options_and_give_sass(compiler):
    """An option NVRTC does not know fails the compile (so the backend's are all known), and
    without a real `-arch=sm_XX` there is no cubin (so the test above compiled SASS)."""
    nv, include = compiler
    text, _ = nvrtc.kernel_program([(join_kernel(scalar.x(0), ("f16",), "float", "bf16"), 1)])
    with pytest.raises(nvrtc.NvrtcError):
        nv.compile(text, _options(include) + ("--no-such-option",),
                   headers=nvrtc.STANDIN_HEADERS)
    no_arch = tuple(o for o in _options(include) if not o.startswith("-arch"))
    with pytest.raises(nvrtc.NvrtcError, match="no cubin"):
        nv.compile(text, no_arch + ("-arch=compute_90",), headers=nvrtc.STANDIN_HEADERS)


def test_fmad_false_keeps_multiply_and_add_apart(compiler):
    """In the PTX of a join the plans run (`x0 + x1*x2`, f32: the kernel where the host FMA
    check measured most contractions), the backend's options leave a rounded multiply and a
    rounded add; without `--fmad=false` NVRTC fuses them. CuPy appends `-ftz=true` after the
    kernel's options (the last one wins), so float32 operations flush subnormals (`.ftz`), which
    NumPy does not."""
    nv, include = compiler
    x0, x1, x2 = scalar.x(0), scalar.x(1), scalar.x(2)
    src = join_kernel(x0 + x1 * x2, ("f32", "f32", "f32"), "float", "f32")
    text, _ = nvrtc.kernel_program([(src, 3)], layouts=nvrtc.LAYOUTS[:1])

    def ptx(options) -> str:
        options = tuple(o if not o.startswith("-arch") else "-arch=compute_90" for o in options)
        return nv.compile(text, options, headers=nvrtc.STANDIN_HEADERS, output="ptx").decode()

    ours = ptx(_options(include))
    assert re.search(r"\bmul\.rn\.ftz\.f32\b", ours) and re.search(r"\badd\.rn\.ftz\.f32\b", ours)
    assert not re.search(r"\bfma\.", ours), ours
    fused = ptx(tuple(o for o in _options(include) if o != "--fmad=false"))
    assert re.search(r"\bfma\.rn\.ftz\.f32\b", fused), fused
    overridden = ptx(tuple(NVRTC_OPTIONS) + ("-ftz=false",) + nvrtc.CUPY_ADDED_OPTIONS
                     + (f"-arch={nvrtc.ARCH}", f"-I{include}"))
    assert ".ftz.f32" in overridden  # a kernel's own -ftz=false cannot undo CuPy's
