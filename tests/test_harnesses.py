"""Short runs of the two plan harnesses in `bench/`: the fuzz sweep (`bench/fuzz_plans.py`:
every compiled plan validates, is proven, round-trips and matches the reference in random
orders) and the mutation harness (`bench/mutants.py`: every harmful mutant of a plan is
refused), and a check that the mutation harness notices a validator that proves nothing."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import fuzz_plans  # noqa: E402
import mutants  # noqa: E402
import mutations  # noqa: E402
from einpage.compiler.policies import POLICIES  # noqa: E402

#: a seed whose first graphs give every mutation class mutants (disk reads and summation
#: chains included) within a few seconds
MUTANT_SEED = 1


def test_fuzz_sweep_of_random_graphs(tmp_path):
    out = tmp_path / "fuzz.json"
    assert fuzz_plans.main(["--count", "40", "--workers", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["plans"] >= 40 and result["failures"] == []
    assert set(result["plans_by_policy"]) == set(POLICIES)
    assert result["refusals"]  # budgets below the smallest are tried too


def test_fuzz_sweep_of_a_llama_graph():
    index = fuzz_plans.LLAMA_EVERY - 1
    tally = fuzz_plans.fuzz(seed=0, graph=index, workers=1)
    assert tally.kinds == {"llama": 1} and tally.plans > 0
    assert tally.failures == []
    assert tally.traits["reload"] and tally.traits["accumulate"]


@pytest.mark.parametrize("graph", [175, 371])
def test_graphs_that_found_a_bug_stay_fixed(graph):
    """Sweep graphs (seed 0) with a join `Piecewise((x0*x1, And(x0 > 0, x1 > 0)), ...)` over
    operands of different (broadcast) shapes, which the NumPy kernels could not evaluate
    (`logical_and.reduce` of arrays of two shapes; fixed in `scalar.numpy_function`)."""
    tally = fuzz_plans.fuzz(seed=0, graph=graph, workers=1)
    assert tally.failures == [] and tally.plans > 0


def test_every_harmful_mutant_is_rejected():
    # 5 mutants a class: every class still gets its mutants and harmful ones among them (8
    # took 23 s of the suite's five minutes); `python bench/mutants.py` runs 100 a class
    tally = mutants.mutate(seed=MUTANT_SEED, count=5, workers=1)
    assert tally.harmful_accepted == [] and tally.crashes == [] and tally.originals == []
    assert tally.over_strict == []  # every relisting in a topological order is accepted
    for cls, row in tally.rows.items():
        assert row["mutants"] >= 5, cls
    control = tally.rows[mutations.CONTROL]
    assert control["equivalent_accepted"] == control["mutants"]
    assert sum(row["harmful"] for row in tally.rows.values()) > 0


def test_the_mutation_harness_notices_a_validator_that_proves_nothing(monkeypatch):
    import einpage.ir.validator as validator
    monkeypatch.setattr(validator, "prove", lambda mg: None)
    tally = mutants.mutate(seed=MUTANT_SEED, count=1, workers=1)
    found = "\n".join(tally.harmful_accepted)
    assert "'swap a read (same shape)'" in found or "'delete a summation-chain apply'" in found
    assert tally.failed()
