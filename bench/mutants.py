"""Mutation harness for the plan validator: mutate version 2 plans at their JSON level, and check
that every mutant that computes something wrong is refused by `MemGraph.from_json` or `validate`.

Plans come from the graphs of `bench/fuzz_plans.py` (random einsum DAGs and tiny LLaMA passes,
every policy, budgets from the smallest up, host budgets that put weights on the disk tier): for
each graph, its fuzz sweep (which checks every plan it makes) and then a few of its plans, those
with disk reads and summation chains first. Each mutation class (`bench/mutations.py`: `MUTATIONS`)
makes a few random mutants per plan, where it applies. A node is deleted or moved with its ids
renumbered and its dependents' edges mapped onto its own deps, so the rest stays well-formed.

For every mutant:
- *rejected*: `MemGraph.from_json` refuses it (it never becomes a plan: "unparsed") or
  `validate` raises `PlanError`;
- *harmful*: run unchecked (`run(..., check=False)`) in the plan's order and in 4 seeded random
  topological orders, a run raises or differs from the dense reference (the tolerance of
  `fuzz_plans.mismatch`). Unparsed mutants cannot run and are not classified.
- *equivalent*: neither rejected nor harmful (a redundant edge dropped, a leak).

The table gives, per class: mutants; rejected, of which unparsed, and of which rejected by the
proof only (the rules that need no graph, all a version 1 plan gets, accept them); harmful;
harmful and accepted (must be 0); equivalent and accepted; the parsed rejected ones split into
harmful and equivalent (refusing an equivalent mutant is allowed); crashes (an exception other
than `PlanError` from `from_json` or `validate`: a failure too). The control class relists a
plan in a random topological order of its edges: a correct validator accepts every such
mutant (one it rejects is listed as over-strict).

    python bench/mutants.py [--count 100] [--seed 0] [--quick] [--workers 2] [--json PATH]
    python bench/mutants.py --seed S --graph G [--only CLASS] [-v]   # replay one graph

`--count` is the number of mutants wanted per class (graphs are mutated in index order until
every class has them, or 40 + count graphs were used). Exits 1 if a harmful mutant was accepted,
the validator crashed, or an unmutated plan failed its fuzz checks.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

HERE = Path(__file__).absolute().parent
if str(HERE) not in sys.path:  # fuzz_plans beside this file (also when loaded by path)
    sys.path.insert(0, str(HERE))
from fuzz_plans import Case, Sweep, execute, make_case, plan_traits  # noqa: E402
from mutations import CONTROL, MUTATIONS, Plan  # noqa: E402

from einpage.errors import PlanError  # noqa: E402
from einpage.ir.memgraph import MemGraph  # noqa: E402
from einpage.ir.validator import validate  # noqa: E402

RUN_ORDERS = 4          # random topological orders a mutant runs in, besides the plan's own
PLANS_PER_GRAPH = 2
PER_PLAN = 2            # mutants per class and plan


def pick_plans(plans: list[tuple[MemGraph, str]], rng: np.random.Generator) -> list:
    """`PLANS_PER_GRAPH` distinct plans, each drawn from the plans not chosen yet that have disk
    reads, else summation chains, else offloads, else reloads, else from all of them."""
    chosen: list = []
    while len(chosen) < PLANS_PER_GRAPH:
        left = [p for p in plans if not any(p is c for c in chosen)]
        if not left:
            break
        for want in ("read", "accumulate", "offload", "reload"):
            pool = [p for p in left if want in plan_traits(p[0])]
            if pool:
                break
        pool = pool or left
        chosen.append(pool[int(rng.integers(len(pool)))])
    return chosen


def graph_plans(seed: int, index: int) -> tuple[Case, list[Plan], list[str]]:
    """The plans of graph `index` to mutate, and the problems its fuzz sweep found."""
    case = make_case(seed, index)
    made: list[tuple[MemGraph, str]] = []

    def keep(a, mg):
        if not a.problems:
            made.append((mg, f"policy={a.policy} device_bytes={a.device_bytes} "
                             f"block_bytes={a.block_bytes} host_bytes={a.host_bytes}"))

    result = Sweep(case, seed, index, on_plan=keep).run()
    problems = [p for a in result.attempts for p in a.problems]
    if result.error:
        problems.append(result.error)
    rng = np.random.default_rng([seed, index, 2])
    plans = [Plan(case, mg, label) for mg, label in pick_plans(made, rng)]
    return case, plans, problems


# ---------------------------------------------------------------------------------- verdicts
@dataclass
class Verdict:
    """What became of one mutant."""
    cls: str
    where: str              # reproducer: graph, plan, class, mutant number
    what: str               # the mutation
    unparsed: bool = False
    rejected: bool = False
    proof_only: bool = False  # rejected, but the rules without the graph accept it
    harmful: bool = False
    raised: bool = False    # harmful: a run raised
    crash: str | None = None
    reason: str = ""        # the first line of the refusal, or of the harm


def judge(case: Case, mutant: dict, cls: str, where: str, what: str, seed: int) -> Verdict:
    v = Verdict(cls, where, what)
    try:
        mg = MemGraph.from_json(json.loads(json.dumps(mutant)))
    except PlanError as exc:
        v.unparsed = v.rejected = True
        v.reason = _first_line(exc)
        return v
    except Exception as exc:
        v.crash = f"from_json raised {type(exc).__name__}: {_first_line(exc)}"
        return v
    try:
        validate(mg)
    except PlanError as exc:
        v.rejected, v.reason = True, _first_line(exc)
        v.proof_only = accepted_without_graph(mg)
    except Exception as exc:
        v.crash = f"validate raised {type(exc).__name__}: {_first_line(exc)}"
    harm = harm_of(case, mg, seed)
    if harm is not None:
        v.harmful, v.raised = True, harm.startswith("raised")
        if not v.rejected:
            v.reason = harm
    return v


def accepted_without_graph(mg: MemGraph) -> bool:
    """Whether the rules that need no graph (memory, order, ops fit their operands: all a
    version 1 plan gets) accept `mg`."""
    try:
        validate(dataclasses.replace(mg, graph=None))
    except PlanError:
        return False
    return True


def harm_of(case: Case, mg: MemGraph, seed: int) -> str | None:
    """How running `mg` unchecked goes wrong (in its order or a random one), or None."""
    for order in ("sequential", *range(seed, seed + RUN_ORDERS)):
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")  # the NaNs of poisoned bytes
                wrong = execute(case, mg, order, check=False)
        except Exception as exc:
            return f"raised in order {order}: {type(exc).__name__}: {_first_line(exc)}"
        if wrong:
            return f"order {order}: {wrong}"
    return None


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


@dataclass
class GraphMutants:
    index: int
    name: str
    plans: int = 0
    verdicts: list = field(default_factory=list)
    problems: list = field(default_factory=list)   # the fuzz sweep's, on the originals


def mutate_graph(seed: int, index: int, only: str | None = None) -> GraphMutants:
    """Every mutant of graph `index`: `PER_PLAN` per class and plan (of class `only`)."""
    case, plans, problems = graph_plans(seed, index)
    result = GraphMutants(index, case.name, len(plans), problems=problems)
    for p_index, plan in enumerate(plans):
        for c_index, (cls, mutate) in enumerate(MUTATIONS.items()):
            if only is not None and cls != only:
                continue
            for j, (mutant, what) in enumerate(distinct_mutants(
                    plan, mutate, [seed, index, p_index, c_index])):
                where = (f"bench/mutants.py --seed {seed} --graph {index} --only '{cls}' "
                         f"(plan {p_index}: {plan.label}; mutant {j})")
                result.verdicts.append(judge(case, mutant, cls, where, what,
                                             seed + 1000 * j + 7))
    return result


def distinct_mutants(plan: Plan, mutate: Callable, key: list[int]) -> list[tuple[dict, str]]:
    """Up to `PER_PLAN` mutants of `plan` with distinct descriptions (a few draws each)."""
    out: dict[str, dict] = {}
    for j in range(3 * PER_PLAN):
        made = mutate(plan, np.random.default_rng([*key, j]))
        if made is None:
            break
        out.setdefault(made[1], made[0])
        if len(out) == PER_PLAN:
            break
    return [(mutant, what) for what, mutant in out.items()]


def _mutate_job(job: tuple[int, int]) -> GraphMutants:
    return mutate_graph(*job)


def graph_mutants(seed: int, count: int, workers: int) -> Iterator[GraphMutants]:
    """Graph results in index order until every class has `count` mutants (or 40 + count
    graphs were mutated)."""
    jobs = ((seed, k) for k in range(40 + count))
    have: Counter = Counter()
    pool = multiprocessing.get_context("fork").Pool(workers) if workers > 1 else None
    results = pool.imap(_mutate_job, jobs) if pool is not None else map(_mutate_job, jobs)
    try:
        for r in results:
            yield r
            have.update(v.cls for v in r.verdicts)
            if all(have[c] >= count for c in MUTATIONS):
                break
    finally:
        if pool is not None:
            pool.terminate()


# ---------------------------------------------------------------------------------- report
COLUMNS = ("mutants", "rejected", "unparsed", "proof_only", "harmful", "harmful_accepted",
           "equivalent_accepted", "rejected_harmful", "rejected_equivalent", "crashes")
HEADINGS = {"proof_only": "rejected by the proof only"}


@dataclass
class Tally:
    seed: int
    graphs: int = 0
    plans: int = 0
    rows: dict = field(default_factory=lambda: {c: Counter() for c in MUTATIONS})
    harmful_accepted: list = field(default_factory=list)
    crashes: list = field(default_factory=list)
    over_strict: list = field(default_factory=list)  # control mutants rejected
    originals: list = field(default_factory=list)    # problems of unmutated plans
    seconds: float = 0.0

    def add(self, r: GraphMutants) -> None:
        self.graphs += 1
        self.plans += r.plans
        self.originals += [f"bench/fuzz_plans.py --seed {self.seed} --graph {r.index} "
                           f"({r.name}): {p}" for p in r.problems]
        for v in r.verdicts:
            row = self.rows[v.cls]
            row["mutants"] += 1
            row["crashes"] += v.crash is not None
            if v.crash is not None:
                self.crashes.append(f"{v.where}: {v.what}: {v.crash}")
                continue
            row["rejected"] += v.rejected
            row["unparsed"] += v.unparsed
            row["proof_only"] += v.proof_only
            row["harmful"] += v.harmful
            if v.unparsed:
                continue
            if v.rejected:
                row["rejected_harmful" if v.harmful else "rejected_equivalent"] += 1
                if v.cls == CONTROL:
                    self.over_strict.append(f"{v.where}: {v.what}: {v.reason}")
            elif v.harmful:
                row["harmful_accepted"] += 1
                self.harmful_accepted.append(f"{v.where}: {v.what}: {v.reason}")
            else:
                row["equivalent_accepted"] += 1

    def table(self) -> str:
        head = ("| class | " + " | ".join(HEADINGS.get(c, c.replace("_", " ")) for c in COLUMNS)
                + " |")
        lines = [head, "| --- |" + " ---: |" * len(COLUMNS)]
        total: Counter = Counter()
        for cls, row in self.rows.items():
            total.update(row)
            lines.append(f"| {cls} | " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
        lines.append("| **all** | " + " | ".join(f"**{total[c]}**" for c in COLUMNS) + " |")
        return "\n".join(lines)

    def failed(self) -> bool:
        return bool(self.harmful_accepted or self.crashes or self.originals)

    def summary(self) -> str:
        n = sum(r["mutants"] for r in self.rows.values())
        rejected = sum(r["rejected"] for r in self.rows.values())
        harmful = sum(r["harmful"] for r in self.rows.values())
        return (f"mutants: {n} mutants of {self.plans} plans ({self.graphs} graphs), "
                f"{rejected} rejected, {harmful} harmful, {len(self.harmful_accepted)} harmful "
                f"accepted, {len(self.crashes)} crashes, {len(self.over_strict)} control "
                f"mutants rejected, {self.seconds:.0f} s")

    def to_json(self) -> dict:
        return {"seed": self.seed, "graphs": self.graphs, "plans": self.plans,
                "classes": {c: dict(r) for c, r in self.rows.items()},
                "harmful_accepted": self.harmful_accepted, "crashes": self.crashes,
                "over_strict": self.over_strict, "original_problems": self.originals,
                "seconds": round(self.seconds, 1)}


def mutate(seed: int = 0, count: int = 100, workers: int = 2, graph: int | None = None,
           only: str | None = None, verbose: bool = False) -> Tally:
    """The harness: graphs from index 0 until every class has `count` mutants (or graph
    `graph` alone, of class `only`)."""
    tally = Tally(seed)
    t0 = time.perf_counter()
    results = ([mutate_graph(seed, graph, only)] if graph is not None
               else graph_mutants(seed, count, workers))
    for r in results:
        tally.add(r)
        if verbose:
            for v in r.verdicts:
                verdict = ("CRASH" if v.crash else "rejected" if v.rejected else
                           "HARMFUL-ACCEPTED" if v.harmful else "equivalent")
                print(f"{verdict:<17} {'harmful ' if v.harmful else ''}{v.where}: {v.what}: "
                      f"{v.crash or v.reason}")
    tally.seconds = time.perf_counter() - t0
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=100, help="mutants per class (100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short run: 10 per class")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--graph", type=int, help="mutate this graph only (a reproducer)")
    parser.add_argument("--only", choices=list(MUTATIONS), help="with --graph: this class only")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every mutant")
    parser.add_argument("--json", type=Path, help="write the table and findings here")
    args = parser.parse_args(argv)
    count = 10 if args.quick else args.count
    tally = mutate(args.seed, count, args.workers, args.graph, args.only, args.verbose)
    print(tally.table())
    for line in tally.harmful_accepted:
        print(f"HARMFUL ACCEPTED {line}")
    for line in tally.crashes:
        print(f"CRASH {line}")
    for line in tally.over_strict:
        print(f"CONTROL REJECTED {line}")
    for line in tally.originals:
        print(f"ORIGINAL PLAN FAILED {line}")
    print(tally.summary())
    if args.json:
        args.json.write_text(json.dumps(tally.to_json(), indent=1) + "\n")
    return 1 if tally.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
