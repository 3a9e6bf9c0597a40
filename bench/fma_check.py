"""Does contracting `a*b + c` into a fused multiply-add change the generated kernels' results?
The measurement behind `cuda_source.NVRTC_OPTIONS`' `--fmad=false` (issue 25).

Every join and reduction kernel of the tiny LLaMA's plans (f32, bf16, f16; prefill and decode;
paged under a small budget, so reductions also run as partials accumulated into their output) is
built for the host twice from its CUDA C, as `tests/host_kernels.py` builds it (its `_host_source`):
once with `-ffp-contract=off` (each operation rounded, as NumPy and NVRTC's `--fmad=false` do) and
once with `-ffp-contract=fast -mfma` (g++ fuses what it can into FMA instructions, as NVRTC's
default `--fmad=true` does on the GPU). Each runs on random inputs; the outputs are compared bit
for bit with NumPy computing the same expression in the same order (a sum reduction sequentially,
as the kernel's loop does, so that only rounding differs).

    python bench/fma_check.py [--n 4096] [--seed 0] [--markdown]

Needs g++ and an x86-64 CPU with FMA (`fma` in /proc/cpuinfo).
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import sympy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from host_kernels import _HOST_HEADER, CXX, _call, _host_source  # noqa: E402

from einpage.compiler import CompileOptions, compile_graph  # noqa: E402
from einpage.ir import scalar  # noqa: E402
from einpage.ir.dtypes import DType  # noqa: E402
from einpage.ir.memgraph import ApplyNode  # noqa: E402
from einpage.ir.ops import EinsumOp  # noqa: E402
from einpage.models import llama  # noqa: E402
from einpage.models.config import preset  # noqa: E402
from einpage.runtime.backends.apply_plan import KernelApply, plan_apply  # noqa: E402
from einpage.runtime.backends.cuda_source import (COMPUTE_CTYPE, DEVICE_DTYPE,  # noqa: E402
                                                  ReductionSource, join_kernel, reduce_kernel)

BUILDS = {"-ffp-contract=off": ["-ffp-contract=off"],
          "-ffp-contract=fast -mfma": ["-ffp-contract=fast", "-mfma"]}
_COMPUTE = {"float": np.float32, "double": np.float64, "long long": np.int64}


def cpu_has_fma() -> bool:
    try:
        return " fma " in f" {Path('/proc/cpuinfo').read_text().replace(chr(10), ' ')} "
    except OSError:
        return False


def llama_specs():
    """Distinct (kernel source, join, tags, ctype, out_tag, factor, combine, agg) of every
    einsum apply of the tiny LLaMA's plans that runs as a generated kernel (not cuBLAS)."""
    specs = {}
    for dtype in (DType.f32, DType.bf16, DType.f16):
        cfg = preset("tiny").with_dtype(dtype)
        for graph in (llama.prefill_graph(cfg).bind(B=2, S=5),
                      llama.decode_graph(cfg).bind(B=2, C=4)):
            mg = compile_graph(graph, CompileOptions(40_000)).memgraph
            for n in mg.nodes:
                if not (isinstance(n, ApplyNode) and isinstance(n.op, EinsumOp)):
                    continue
                plan = plan_apply(mg, n)
                if not isinstance(plan, KernelApply):
                    continue
                op = n.op
                tags = tuple(mg.tensors[r.tensor].dtype.value for r in n.reads)
                out_tag = mg.tensors[n.write.tensor].dtype.value
                ctype = COMPUTE_CTYPE[op.dtype.value]
                combine = (op.agg or "sum") if n.accumulate else None
                factor = scalar.scaled_product_factor(op.join, len(n.reads))
                product = factor is not None and op.agg in (None, "sum")
                join, scale = ((scalar.product(len(n.reads)), factor) if product
                               else (op.join, None))
                if op.spec.contracted:
                    src = reduce_kernel(join, tags, ctype, out_tag, op.agg, scale, combine)
                else:
                    src = join_kernel(join, tags, ctype, out_tag, scale, combine)
                # the same kernel the backend runs (apply_plan made it the same way)
                assert src is plan.kernel, (src.name, plan.kernel.name)
                specs[src.name] = (src, join, tags, ctype, out_tag, scale, combine, op.agg)
    return list(specs.values())


def build(sources, flags, directory: Path):
    text = _HOST_HEADER + "\n".join(_host_source(s) for s in sources)
    cpp = directory / f"k{len(list(directory.iterdir()))}.cpp"
    lib = cpp.with_suffix(".so")
    cpp.write_text(text)
    subprocess.run([CXX, "-O2", *flags, "-shared", "-fPIC", "-w", "-o", str(lib), str(cpp)],
                   check=True, capture_output=True, text=True)
    dll = ctypes.CDLL(str(lib))
    out = {}
    for s in sources:
        fn = getattr(dll, s.name)
        fn.restype = None
        out[s.name] = fn
    return out


def stored(values: np.ndarray, tag: str) -> np.ndarray:
    """`values` as the device stores `tag` (bf16 as its bits)."""
    with np.errstate(over="ignore"):
        if tag == "bf16":
            return values.astype(np.float32).astype(DType.bf16.numpy).view(np.uint16)
        return values.astype(DType(tag).numpy)


def loaded(bits: np.ndarray, tag: str, compute) -> np.ndarray:
    if tag == "bf16":
        return bits.view(DType.bf16.numpy).astype(np.float32).astype(compute)
    return bits.astype(compute)


def reference(spec, inputs, y0):
    """What NumPy computes for the kernel, in the kernel's order of operations."""
    src, join, tags, ctype, out_tag, factor, combine, agg = spec
    compute = _COMPUTE[ctype]
    xs = [loaded(x, t, compute) for x, t in zip(inputs, tags)]
    with np.errstate(all="ignore"):
        part = np.asarray(scalar.join_function(join, len(xs))(*xs)).astype(compute, copy=False)
        part = np.broadcast_to(part, np.broadcast_shapes(*[x.shape for x in xs]))
        if isinstance(src, ReductionSource):
            if agg == "sum":  # the kernel's loop: 0 + p0 + p1 + ... in order
                part = np.cumsum(part, axis=-1, dtype=compute)[..., -1]
            else:
                part = (np.maximum if agg == "max" else np.minimum).reduce(part, axis=-1)
        if factor is not None:
            part = part * compute(factor)
        if combine is not None:
            y = loaded(y0, out_tag, compute)
            part = {"sum": np.add, "max": np.maximum, "min": np.minimum}[combine](y, part)
        return stored(np.asarray(part, compute), out_tag)


def run_kernel(fn, spec, inputs, y0):
    src = spec[0]
    y = y0.copy()
    arrays = [np.ascontiguousarray(x) for x in inputs] + [y]
    if isinstance(src, ReductionSource):
        shape = inputs[0].shape
        strides = [x.strides for x in inputs] + [tuple(y.strides) + (0,)]
        _call(fn, arrays, shape, strides, [0], nout=1)
    else:
        _call(fn, arrays, y.shape, [x.strides for x in arrays], [])
    return y


def random_inputs(spec, n: int, rng):
    src, _, tags, _, out_tag, *_ = spec
    if isinstance(src, ReductionSource):
        side = max(2, int(round(n ** 0.5)))
        shape, out_shape = (side, side), (side,)
    else:
        shape = out_shape = (n,)
    inputs = [stored(rng.standard_normal(shape) * 2.0, t) for t in tags]
    y0 = stored(rng.standard_normal(out_shape), out_tag)
    return inputs, y0


def differing(a: np.ndarray, b: np.ndarray) -> int:
    a = a.view(f"u{a.itemsize}")
    b = b.view(f"u{b.itemsize}")
    return int(np.count_nonzero(a != b))


def ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance in units in the last place (same-sign finite values)."""
    if a.dtype == np.uint16:  # bf16 bits
        a, b = a.view(np.int16), b.view(np.int16)
    else:
        a, b = a.view(f"i{a.itemsize}"), b.view(f"i{b.itemsize}")
    d = np.abs(a.astype(np.int64) - b.astype(np.int64))
    return int(d.max()) if d.size else 0


_TRANSCENDENTAL = (sympy.exp, sympy.log, sympy.sin, sympy.cos, sympy.tan, sympy.tanh, sympy.erf)


def kind_of(spec) -> str:
    src, join = spec[0], spec[1]
    if isinstance(src, ReductionSource):
        return "reduction"
    if join.has(*_TRANSCENDENTAL):
        return "join with exp / sin / cos"
    return "join: + - * / sqrt max"


def subnormal(values: np.ndarray, tag: str) -> int:
    """Outputs NumPy makes subnormal (the device's `-ftz=true`, which CuPy always passes, would
    flush float32 ones to zero)."""
    if tag not in ("f32", "f64"):
        return 0
    v = np.abs(values.astype(np.float64))
    return int(np.count_nonzero((v > 0) & (v < np.finfo(DEVICE_DTYPE[tag]).tiny)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=65536,
                    help="outputs per elementwise kernel (a reduction: sqrt(n) sums of sqrt(n))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if CXX is None:
        sys.exit("no g++")
    if not cpu_has_fma():
        sys.exit("this CPU has no FMA: the contracted build would not use it")
    specs = llama_specs()
    rng = np.random.default_rng(args.seed)
    cases = [(spec, *random_inputs(spec, args.n, rng)) for spec in specs]
    want = [reference(spec, x, y0) for spec, x, y0 in cases]
    rows = defaultdict(lambda: defaultdict(int))
    with tempfile.TemporaryDirectory() as tmp:
        for label, flags in BUILDS.items():
            fns = build([s[0] for s in specs], flags, Path(tmp))
            for (spec, x, y0), w in zip(cases, want):
                got = run_kernel(fns[spec[0].name], spec, x, y0)
                row = rows[(kind_of(spec), spec[4])]
                row[label] += differing(got, w)
                row[label + " kernels"] += differing(got, w) > 0
                row[label + " ulps"] = max(row[label + " ulps"], ulps(got, w))
                if label == next(iter(BUILDS)):
                    row["kernels"] += 1
                    row["outputs"] += w.size
                    row["subnormal"] += subnormal(w, spec[4])
    head = ["kernel kind", "out dtype", "kernels", "outputs"]
    for label in BUILDS:
        head += [f"`{label}`: outputs (kernels) differing from NumPy, max ulps"]
    head += ["NumPy subnormal outputs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total = defaultdict(int)
    for (kind, tag), row in sorted(rows.items()):
        cells = [kind, tag, str(row["kernels"]), str(row["outputs"])]
        for label in BUILDS:
            cells.append(f"{row[label]} ({row[label + ' kernels']}), "
                         f"{row[label + ' ulps']}")
            total[label] += row[label]
            total[label + " kernels"] += row[label + " kernels"]
        cells.append(str(row["subnormal"]))
        for k in ("kernels", "outputs", "subnormal"):
            total[k] += row[k]
        lines.append("| " + " | ".join(cells) + " |")
    cells = ["**all**", "", str(total["kernels"]), str(total["outputs"])]
    cells += [f"**{total[label]} ({total[label + ' kernels']})**" for label in BUILDS]
    cells.append(str(total["subnormal"]))
    lines.append("| " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if not args.markdown:
        print(f"\n{len(specs)} distinct join/reduction kernels, seed {args.seed}, g++ -O2, "
              f"n {args.n}")


if __name__ == "__main__":
    main()
