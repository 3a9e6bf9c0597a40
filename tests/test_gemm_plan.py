"""GEMM plans and layouts of the CuPy backend (`einpage.runtime.backends.gemm_plan`), on any
machine: plans for many specs, run with `xp=numpy`, equal `np.einsum`, and the views they claim
need no copy are views; LLaMA's projections read their weights in place; the broadcast views a
generated kernel reads and no-copy reshapes equal NumPy's.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from einpage.ir import scalar
from einpage.ir.dtypes import DType
from einpage.ir.spec import EinsumSpec
from einpage.runtime import kernels
from einpage.runtime.backends.gemm_call import CUBLAS_OP_N, layout, matrix
from einpage.runtime.backends.gemm_plan import (MatmulOps, execute_matmul, matmul_plan,
                                                nocopy_reshape_strides, operand_layout)

SPECS = ["ab,bc->ac", "ab,cb->ac", "ba,bc->ca", "bhqd,bhkd->bhqk", "bsm,fm->bsf", "bsf,mf->bsm",
         "bsm,ngrjm->bsngrj", "bsngrj,mngrj->bsm", "bngst,btnrj->bsngrj", "bsnguj,btnuj->bngst",
         "bsngrj,surj->bsnguj", "ab,b->a", "a,a->", "abc,cd->dba", "ka,kb->ba", "xab,xbc->cax",
         "b,b->b", "ij,j->i", "j,ij->i"]


def _reference_apply(spec, a, b, factor, write, accumulate, compute):
    part = kernels.einsum(EinsumSpec.parse(spec), factor * scalar.product(2), "sum", [a, b],
                          compute)
    if accumulate:
        part = kernels.combine("sum", write.astype(compute), part)
    return part.astype(write.dtype)


def _run_plan(spec, shapes, tags, out_tag, factor, accumulate, seed=0):
    """(plan, result, reference, operands) of one GEMM apply run with NumPy; Nones without a
    GEMM form."""
    rng = np.random.default_rng(seed)
    es = EinsumSpec.parse(spec)
    compute_tag = ("f64" if "f64" in tags or out_tag == "f64" else
                   "f16" if set(tags) == {"f16"} else "f32")
    plan = matmul_plan(es, shapes, tags, compute_tag, out_tag, factor, accumulate)
    if plan is None:
        return None, None, None, None
    a, b = (rng.standard_normal(s).astype(DType(t).numpy) for s, t in zip(shapes, tags))
    write = rng.standard_normal(es.output_shape(shapes)).astype(DType(out_tag).numpy)
    want = _reference_apply(spec, a, b, factor, write, accumulate, DType(compute_tag).compute)
    got = write.copy()
    execute_matmul(plan, MatmulOps(np, plan), a, b, got)
    return plan, got, want, (a, b)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("factor, accumulate", [(1.0, False), (0.25, False), (1.0, True),
                                                (0.5, True)])
@pytest.mark.parametrize("tags, out_tag", [(("f64", "f64"), "f64"), (("f32", "f32"), "f32"),
                                           (("bf16", "f32"), "bf16"), (("f16", "f16"), "f32"),
                                           (("f16", "f16"), "f16")])
def test_matmul_plans_equal_einsum(spec, factor, accumulate, tags, out_tag):
    es = EinsumSpec.parse(spec)
    rng = np.random.default_rng(len(spec))
    sizes = {c: int(rng.integers(2, 5)) for c in set("".join(es.inputs))}
    shapes = [tuple(sizes[c] for c in t) for t in es.inputs]
    plan, got, want, _ = _run_plan(spec, shapes, tags, out_tag, factor, accumulate)
    if not es.contracted:
        assert plan is None  # a product without a sum runs as an elementwise kernel
        return
    assert plan is not None
    tol = 1e-12 if out_tag == "f64" else (2e-2 if {"bf16", "f16"} & {*tags, out_tag} else 1e-4)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol,
                               atol=tol, err_msg=f"{spec}: {plan}")


@st.composite
def two_operand_specs(draw):
    letters = "abcdef"
    used = draw(st.lists(st.sampled_from(letters), min_size=1, max_size=5, unique=True))
    a = draw(st.permutations(used)).copy()[:draw(st.integers(0, len(used)))]
    rest = [c for c in used if c not in a]
    b = draw(st.permutations(used))[:draw(st.integers(0, len(used)))]
    b = list(dict.fromkeys(list(b) + rest))
    both = [c for c in dict.fromkeys(a + b)]
    out = [c for c in draw(st.permutations(both)) if draw(st.booleans())]
    sizes = {c: draw(st.integers(1, 4)) for c in both}
    return f"{''.join(a)},{''.join(b)}->{''.join(out)}", sizes


@settings(max_examples=150, deadline=None)
@given(case=two_operand_specs(), factor=st.sampled_from([1.0, 0.5]), accumulate=st.booleans(),
       direct_dtype=st.booleans(), seed=st.integers(0, 100))
def test_random_matmul_plans_equal_einsum(case, factor, accumulate, direct_dtype, seed):
    spec, sizes = case
    es = EinsumSpec.parse(spec)
    shapes = [tuple(sizes[c] for c in t) for t in es.inputs]
    tags = ("f64", "f64") if direct_dtype else ("f32", "f64")
    plan, got, want, operands = _run_plan(spec, shapes, tags, "f64", factor, accumulate, seed)
    if plan is None:
        a, b = es.inputs
        assert not es.contracted or any(c not in es.output for c in set(a) ^ set(b))
        return
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=str(plan))
    # what the plan reads without a copy is a view of the operand (no hidden copy in reshape)
    x, y = operands[::-1] if plan.swap else operands
    for arr, op in ((x, plan.left), (y, plan.right)):
        if not op.copy:
            view = arr.transpose(op.perm).reshape(op.gemm_shape)
            assert np.shares_memory(view, arr) or arr.size <= 1
            # cuBLAS reads it in place: row- or column-major, any leading dimension and
            # batch stride
            layout(matrix(view.shape, view.strides, "f64"), "operand")
    if plan.direct:
        out = np.empty(es.output_shape(shapes))
        c = out.transpose(np.argsort(plan.c_perm)).reshape(plan.c_shape)
        assert np.shares_memory(c, out) or out.size <= 1
        assert layout(matrix(c.shape, c.strides, "f64"), "c")[0] == CUBLAS_OP_N


def test_weight_matmuls_need_no_copy():
    """LLaMA's projections read Hugging Face's [out, in] weights transposed in place."""
    plan = matmul_plan(EinsumSpec.parse("bsm,fm->bsf"), [(1, 6, 32), (48, 32)],
                          ("f32", "f32"), "f32", "f32", 1.0, False)
    assert not plan.batched and not plan.left.copy and not plan.right.copy and plan.direct
    assert plan.temps == ()
    staged = matmul_plan(EinsumSpec.parse("bsm,fm->bsf"), [(1, 6, 32), (48, 32)],
                            ("f32", "f32"), "f32", "f32", 1.0, False, staged=True)
    assert not staged.direct and staged.temps == (6 * 48 * 4,)


def test_half_projections_run_on_tensor_cores():
    """Two f16 (bf16) operands stay f16 (bf16): no conversions, cuBLAS accumulates in float32,
    writes the block itself and accumulates into it with beta 1; the factor is alpha."""
    spec, shapes = EinsumSpec.parse("bsm,vm->bsv"), [(1, 6, 32), (64, 32)]
    for tag in ("f16", "bf16"):
        for out_tag, accumulate, factor in ((tag, False, 1.0), (tag, True, 0.5),
                                            ("f32", True, 1.0)):
            plan = matmul_plan(spec, shapes, (tag, tag), "f32", out_tag, factor, accumulate)
            assert plan.ab_tag == tag and plan.c_tag == out_tag and plan.direct
            assert plan.temps == () and plan.alpha == factor
            assert plan.beta == (1.0 if accumulate else 0.0)
    mixed = matmul_plan(spec, shapes, ("bf16", "f32"), "f32", "f32", 1.0, False)
    assert mixed.ab_tag == "f32" and mixed.left.copy and not mixed.right.copy and mixed.direct
    wide = matmul_plan(spec, shapes, ("bf16", "bf16"), "f64", "f64", 1.0, False)
    assert wide.ab_tag == "f64" and wide.left.copy and wide.right.copy


def test_batched_operands_are_read_transposed_in_place():
    """Attention's `bhqd,bhkd->bhqk` reads k transposed: strided-batched GEMMs take transpose
    flags as plain GEMMs do, so no operand is copied."""
    plan = matmul_plan(EinsumSpec.parse("bhqd,bhkd->bhqk"), [(2, 4, 8, 16), (2, 4, 8, 16)],
                       ("f16", "f16"), "f32", "f32", 0.25, False)
    assert plan.batched and not plan.left.copy and not plan.right.copy and plan.direct
    assert plan.temps == ()


def test_dot_products_are_one_by_one_gemms():
    plan = matmul_plan(EinsumSpec.parse("a,a->"), [(5,), (5,)], ("f32", "f32"), "f32",
                       "f32", 1.0, False)
    assert not plan.batched and plan.c_shape == (1, 1) and plan.direct


# ====================================================================== kernel layouts

@settings(max_examples=100, deadline=None)
@given(case=two_operand_specs(), agg=st.sampled_from(["sum", "max", "min"]),
       seed=st.integers(0, 100))
def test_kernel_layouts_equal_reference(case, agg, seed):
    """The broadcast views a generated kernel reads (`operand_layout`) give the reference."""
    spec, sizes = case
    es = EinsumSpec.parse(spec)
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(tuple(sizes[c] for c in t)) for t in es.inputs]
    join = scalar.exp(scalar.x(0) / 4) - scalar.x(1)
    want = kernels.einsum(es, join, agg if es.contracted else None, arrays, np.dtype(np.float64))
    order = es.join_indices
    views = [np.lib.stride_tricks.as_strided(a, *operand_layout(t, order, sizes, 8))
             for a, t in zip(arrays, es.inputs)]
    value = scalar.join_function(join, 2)(*views)
    if es.contracted:
        value = {"sum": np.sum, "max": np.max, "min": np.min}[agg](
            value, axis=tuple(range(len(es.output), len(order))))
    np.testing.assert_allclose(value, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_nocopy_reshape_strides_match_numpy(shape, data):
    base = np.arange(int(np.prod(shape)) * 2, dtype=np.float32).reshape([2] + shape)
    view = base[1].transpose(data.draw(st.permutations(range(len(shape)))))
    if data.draw(st.booleans()) and view.shape[0] > 1:
        view = view[:-1]
    sizes = [int(v) for v in np.array(view.shape)]
    factors = data.draw(st.permutations(sizes))
    newshape = [int(np.prod(factors))] if data.draw(st.booleans()) else factors
    newshape = data.draw(st.sampled_from([newshape, sizes[::-1], [1] + sizes]))
    if int(np.prod(newshape)) != view.size:
        return
    strides = nocopy_reshape_strides(view.shape, view.strides, newshape, 4)
    try:
        expected = view.reshape(newshape, copy=False)
    except ValueError:
        assert strides is None
        return
    assert strides is not None
    got = np.lib.stride_tricks.as_strided(view, newshape, strides)
    np.testing.assert_array_equal(got, expected)
