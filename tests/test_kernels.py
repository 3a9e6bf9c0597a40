"""The NumPy kernels' direct path: a two-operand contraction written into the arena as one
(batched) matmul equals `np.einsum`, and declines (writing nothing) whatever is not a matmul."""
from __future__ import annotations

import numpy as np
import pytest

from einpage.ir import scalar
from einpage.ir.spec import EinsumSpec
from einpage.runtime.kernels import einsum_into

DIRECT = ["ij,jk->ik", "ij,kj->ik", "ij,jk->ki", "bij,bjk->bik", "bsnd,btnd->bnst",
          "bsm,fm->bsf", "bsm,nrjm->bsnrj", "bsngrj,mngrj->bsm", "ij,j->i", "i,i->",
          "abc,cd->dab"]
DECLINED = ["bngst,btnrj->bsngrj", "ij,jk->ijk", "ij,jk->", "ij,k->ik"]


def _case(text, seed):
    rng = np.random.default_rng(seed)
    dims = {c: int(rng.integers(1, 6)) for c in text if c.isalpha()}
    terms, out = text.split("->")
    arrays = [rng.standard_normal([dims[c] for c in t]).astype(np.float32)
              for t in terms.split(",")]
    return EinsumSpec.parse(text), arrays, np.full([dims[c] for c in out], np.nan, np.float32)


@pytest.mark.parametrize("text", DIRECT)
@pytest.mark.parametrize("seed", range(3))
def test_direct_matmul_equals_einsum(text, seed):
    spec, arrays, out = _case(text, seed)
    assert einsum_into(spec, 0.5 * scalar.product(2), "sum", arrays, out)
    np.testing.assert_allclose(out, 0.5 * np.einsum(text, *arrays), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("text", DECLINED)
def test_what_is_not_a_matmul_is_declined_untouched(text):
    spec, arrays, out = _case(text, 0)
    assert not einsum_into(spec, scalar.product(2), "sum", arrays, out)
    assert np.isnan(out).all()


def test_declined_when_the_write_overlaps_an_input_or_dtypes_differ():
    spec, (a, b), _ = _case("ij,jk->ik", 1)
    square = np.ones((3, 3), np.float32)
    assert not einsum_into(EinsumSpec.parse("ij,jk->ik"), scalar.product(2), "sum",
                           [square, square], square)
    out = np.zeros((a.shape[0], b.shape[1]), np.float64)
    assert not einsum_into(spec, scalar.product(2), "sum", [a, b], out)
    assert not einsum_into(spec, scalar.product(2), "max", [a, b], out.astype(np.float32))
