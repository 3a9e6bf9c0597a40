"""Fuzz sweep of compiled plans: every plan the compiler makes for random graphs must validate,
be proven to compute its graph, round-trip through its JSON text, and give the dense reference's
answer in its own node order and in random topological orders of its edges.

Graphs: random DAGs from a seeded NumPy generator (matmuls with weights, contractions of two
activations and three-operand einsums, so summation chains appear when a contracted index is
cut; elementwise joins and unary maps over `einpage.ir.scalar.FUNCTIONS`; sum/max/min
reductions; index fills; a masked softmax with a -oo causal fill; slice + concat; reshapes that
merge or split dims; gathers), f32 or f64, and every fifth graph a tiny LLaMA prefill or decode
step. For each graph, one block size (`block_bytes`: the default share of the budget, or
128..1024 bytes for random graphs, 2048 or 4096 for LLaMA) and, for every policy of
`einpage.compiler.policies.POLICIES`:

- the smallest budget that compiles, found from the one a `BudgetError` names (and growing it
  where the named one still fails);
- budgets near and above the reuse-distance policy's smallest one, up to a generous one where
  everything fits (a policy may refuse one: `none` where the pass does not fit, `layerwise`
  where a layer's weights do not);
- for the evicting policies, small host budgets (`host_bytes`: the smallest a `BudgetError`
  names, and a little more), which put weight blocks on the disk tier.

Every compile attempt is a plan (checked) or a refusal (a `BudgetError`, counted by reason;
any other exception is a failure). A plan fails when `validate` raises or does not prove it,
its applies do not run every task once, its arena is not the budget or its host memory exceeds
the host budget, its JSON text does not load back valid and proven and print the same JSON
again, or a run (its order and two seeded random topological orders) differs from
`einpage.runtime.reference.evaluate` in float64 (rtol = atol = 1e-4 for f32 outputs, the atol
scaled by the output's largest magnitude; 1e-9 for f64).

    python bench/fuzz_plans.py [--count 10000] [--seed 0] [--quick] [--workers 2] [--json PATH]
    python bench/fuzz_plans.py --seed S --graph G        # one graph again (a failure's reproducer)

`--count` is the number of plans (refusals come on top); graphs are swept in index order until
it is reached, so a seed gives the same plans with any number of workers. Prints the counts per
policy, the refusals by reason, every failure with its reproducer, and a one-line summary;
`--json` writes them too. Exits 1 if any plan (or graph) failed. 10,000 plans take about two
minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import sympy

from einpage.compiler import CompileOptions, compile_graph
from einpage.compiler.policies import POLICIES
from einpage.errors import BudgetError, PlanError
from einpage.ir import GraphBuilder, scalar
from einpage.ir.dtypes import as_dtype
from einpage.ir.graph import Graph, Input, Role
from einpage.ir.memgraph import MemGraph
from einpage.ir.validator import validate
from einpage.models import llama, resolve
from einpage.runtime import evaluate, run

ALIGN = 256
#: block sizes (`block_bytes`; None: the default share of the budget), small enough to cut the
#: contracted indices of random graphs (summation chains); LLaMA graphs are bigger
BLOCKS = (None, 128, 256, 384, 512, 1024)
LLAMA_BLOCKS = (None, 2048, 4096)
EVICTING = tuple(name for name, cls in POLICIES.items() if cls.evicts)
#: every LLAMA_EVERY-th graph is a tiny LLaMA pass, cycling through these
LLAMA_CASES = (("tiny", "prefill", {"B": 1, "S": 4}), ("tiny", "decode", {"B": 2, "C": 4}),
               ("tiny-tied", "prefill", {"B": 2, "S": 3}), ("tiny", "decode", {"B": 1, "C": 6}),
               ("tiny", "prefill", {"B": 1, "S": 2}), ("tiny-tied", "decode", {"B": 2, "C": 3}))
LLAMA_EVERY = 5
#: random orders each plan also runs in, besides its own
RANDOM_ORDERS = 2
PROBES = 16

x0, x1 = scalar.x(0), scalar.x(1)
BINARY = (x0 + x1, x0 * x1, x0 - x1, sympy.Max(x0, x1), sympy.Min(x0, x1),
          x0 * sympy.exp(-sympy.Abs(x1)), sympy.sin(x0) + sympy.cos(x1),
          sympy.sqrt(x0 * x0 + x1 * x1 + 1), sympy.log(1 + x0 * x0) * x1,
          sympy.Piecewise((x0 * x1, sympy.And(x0 > 0, x1 > 0)), (0, True)),
          sympy.Piecewise((sympy.Max(x0, x1), sympy.Or(x0 > 0, x1 > 0)), (0, True)),
          sympy.Piecewise((x0, sympy.Ne(x0, x1)), ((x0 + x1) / 2, True)))
UNARY = (x0 / (1 + sympy.exp(-x0)), sympy.sqrt(x0 * x0 + 1), sympy.Abs(x0),
         sympy.exp(-x0 * x0), sympy.Piecewise((x0, x0 > 0), (x0 / 10, True)))


# ------------------------------------------------------------------------------- cases
@dataclass
class Case:
    """A concrete graph with its inputs and weights, and its float64 reference answer."""
    name: str
    graph: Graph
    inputs: dict
    weights: dict
    kind: str = "random"  # or "llama"
    reference: dict = field(init=False)

    def __post_init__(self):
        self.reference = evaluate(self.graph, self.inputs, self.weights.__getitem__,
                                  float64=True)

    @property
    def weight_source(self) -> Callable[[str], np.ndarray]:
        return self.weights.__getitem__

    @property
    def data_bytes(self) -> int:
        return sum(n.dtype.itemsize * int(np.prod(n.shape)) for n in self.graph.nodes)


def make_case(seed: int, index: int) -> Case:
    """Graph `index` of the sweep with `seed`."""
    if index % LLAMA_EVERY == LLAMA_EVERY - 1:
        return llama_case(index // LLAMA_EVERY, seed)
    return RandomGraph(np.random.default_rng([seed, index])).build(f"random#{index}")


def llama_case(k: int, seed: int) -> Case:
    """The `k`-th tiny LLaMA pass (cycling through `LLAMA_CASES`), with random weights and
    inputs: token ids, and for a decode step positions and a KV store."""
    model, phase, sizes = LLAMA_CASES[k % len(LLAMA_CASES)]
    cfg, source = resolve(model, random_weights=True, seed=seed + k)
    make = llama.prefill_graph if phase == "prefill" else llama.decode_graph
    graph = make(cfg).bind(**sizes)
    rng = np.random.default_rng([seed, k, 7])
    inputs, weights = {}, {}
    for node in graph.nodes:
        op = node.op
        if not isinstance(op, Input):
            continue
        if op.role is Role.weight:
            weights[op.name] = np.asarray(source(op.name))
        elif op.name == "tokens":
            inputs[op.name] = rng.integers(0, cfg.vocab, node.shape)
        elif op.name == "pos":
            inputs[op.name] = rng.integers(0, sizes["C"], node.shape)
        else:  # the KV store
            inputs[op.name] = rng.standard_normal(node.shape).astype(node.dtype.numpy)
    name = f"{model} {phase} " + " ".join(f"{k}={v}" for k, v in sizes.items())
    return Case(name, graph, inputs, weights, "llama")


class RandomGraph:
    """A random DAG of einsum-family nodes, built step by step. Each live tensor carries its
    index letters; a letter has one size throughout the graph."""
    LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    MAX_RANK = 3

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.g = GraphBuilder()
        self.dtype = "f32" if rng.random() < 0.5 else "f64"
        self.numpy = as_dtype(self.dtype).numpy
        self.sizes: dict[str, int] = {}
        self.inputs: dict[str, np.ndarray] = {}
        self.weights: dict[str, np.ndarray] = {}
        self.live: list[tuple[object, str]] = []

    # ------------------------------------------------------------ helpers
    def letter(self, size: int | None = None) -> str:
        c = self.LETTERS[len(self.sizes)]
        self.sizes[c] = int(size if size is not None else self.rng.integers(1, 13))
        return c

    def shape(self, term: str) -> tuple[int, ...]:
        return tuple(self.sizes[c] for c in term)

    def pick(self) -> tuple[object, str]:
        return self.live[int(self.rng.integers(len(self.live)))]

    def choice(self, options):
        return options[int(self.rng.integers(len(options)))]

    def activation(self, term: str) -> object:
        name = f"x{len(self.inputs)}"
        self.inputs[name] = self.rng.standard_normal(self.shape(term)).astype(self.numpy)
        return self.g.input(name, self.shape(term), self.dtype)

    def weight(self, term: str) -> object:
        name = f"w{len(self.weights)}"
        scale = self.sizes[term[0]] ** -0.5
        self.weights[name] = (scale * self.rng.standard_normal(self.shape(term))).astype(
            self.numpy)
        return self.g.input(name, self.shape(term), self.dtype, role="weight")

    def add(self, t, term: str) -> None:
        self.live.append((t, term))

    def room(self) -> bool:
        return len(self.sizes) < len(self.LETTERS) - 4

    # ------------------------------------------------------------ steps
    def matmul(self) -> None:
        t, term = self.pick()
        c, n = self.choice(term), self.letter()
        w = self.weight(c + n)
        self.add(self.g.einsum(f"{term},{c}{n}->{term.replace(c, '')}{n}", t, w),
                 term.replace(c, "") + n)

    def three(self) -> None:
        """A three-operand einsum (split into pairwise steps by the builder)."""
        t, term = self.pick()
        c, n1, n2 = self.choice(term), self.letter(), self.letter()
        w1, w2 = self.weight(c + n1), self.weight(n1 + n2)
        out = term.replace(c, "") + n2
        self.add(self.g.einsum(f"{term},{c}{n1},{n1}{n2}->{out}", t, w1, w2), out)

    def contract(self) -> None:
        """Two activations sharing an index, contracted over it (attention's q.k)."""
        (t, a), (u, b) = self.pick(), self.pick()
        shared = [c for c in a if c in b]
        if not shared:
            return
        c = self.choice(shared)
        out = "".join(dict.fromkeys((a + b).replace(c, "")))
        if out and len(out) <= self.MAX_RANK and (t is not u or a != b):
            self.add(self.g.einsum(f"{a},{b}->{out}", t, u), out)

    def ewise(self) -> None:
        (t, a), (u, b) = self.pick(), self.pick()
        if set(b) <= set(a):
            self.add(self.g.einsum(f"{a},{b}->{a}", t, u, join=self.choice(BINARY)), a)

    def unary(self) -> None:
        t, a = self.pick()
        self.add(self.g.einsum(f"{a}->{a}", t, join=self.choice(UNARY)), a)

    def reduce(self) -> None:
        t, a = self.pick()
        if len(a) < 2:
            return
        c = self.choice(a)
        agg = self.choice(("sum", "max", "min"))
        join = self.choice((x0, sympy.Abs(x0), x0 * x0))
        self.add(self.g.einsum(f"{a}->{a.replace(c, '')}", t, join=join, agg=agg),
                 a.replace(c, ""))

    def fill(self) -> None:
        t, a = self.pick()
        idx = [scalar.index(k) for k in range(len(a))]
        expr = self.choice((sum((k + 1) * v for k, v in enumerate(idx)) / 7,
                            sympy.sin(idx[0] / 2) * sympy.cos(idx[-1] / 3),
                            sympy.Piecewise((1, sympy.Eq(idx[0], idx[-1])), (0, True))))
        f = self.g.fill(self.shape(a), expr, dtype=self.dtype)
        self.add(self.g.einsum(f"{a},{a}->{a}", t, f, join=self.choice(BINARY)), a)

    def softmax(self) -> None:
        """Softmax over the last index after a causal mask (a -oo fill): max, exp, sum,
        divide."""
        t, a = self.pick()
        if len(a) < 2:
            return
        i0, i1 = scalar.index(0), scalar.index(len(a) - 1)
        mask = self.g.fill(self.shape(a), sympy.Piecewise((0, i1 <= i0), (-sympy.oo, True)),
                           dtype=self.dtype)
        r = a[:-1]
        top = self.g.einsum(f"{a},{a}->{r}", t, mask, join=x0 + x1, agg="max")
        e = self.g.einsum(f"{a},{a},{r}->{a}", t, mask, top,
                          join=sympy.exp(x0 + x1 - scalar.x(2)))
        z = self.g.einsum(f"{a}->{r}", e)
        self.add(self.g.einsum(f"{a},{r}->{a}", e, z, join=x0 / x1), a)

    def halves(self) -> None:
        t, a = self.pick()
        n = self.sizes[a[0]]
        if n < 2:
            return
        lo, hi = self.g.slice(t, 0, 0, n // 2), self.g.slice(t, 0, n // 2, n)
        self.add(self.g.concat([hi, lo], 0), a)

    def reshape(self) -> None:
        t, a = self.pick()
        if len(a) >= 2 and self.rng.random() < 0.5:  # merge two adjacent dims
            k = int(self.rng.integers(len(a) - 1))
            c = self.letter(self.sizes[a[k]] * self.sizes[a[k + 1]])
            term = a[:k] + c + a[k + 2:]
        else:  # split a dim of even size
            k = int(self.rng.integers(len(a)))
            n = self.sizes[a[k]]
            if n % 2 or len(a) >= self.MAX_RANK:
                return
            term = a[:k] + self.letter(2) + self.letter(n // 2) + a[k + 1:]
        self.add(self.g.reshape(t, self.shape(term)), term)

    def gather(self) -> None:
        """Rows of a live tensor picked by an ids input."""
        t, a = self.pick()
        k = self.letter()
        name = f"ids{len(self.inputs)}"
        self.inputs[name] = self.rng.integers(0, self.sizes[a[0]], self.sizes[k])
        ids = self.g.input(name, (self.sizes[k],), "i64")
        self.add(self.g.gather(t, ids), k + a[1:])

    STEPS = ("matmul", "matmul", "three", "contract", "ewise", "unary", "reduce", "fill",
             "softmax", "halves", "reshape", "gather")

    def build(self, name: str) -> Case:
        first = self.letter() + self.letter()
        self.add(self.activation(first), first)
        if self.rng.random() < 0.5:
            second = first[int(self.rng.integers(2))] + self.letter()
            self.add(self.activation(second), second)
        for _ in range(int(self.rng.integers(3, 11))):
            if not self.room():
                break
            getattr(self, self.choice(self.STEPS))()
        outputs = {len(self.live) - 1, int(self.rng.integers(len(self.live)))}
        for k in sorted(outputs):
            self.g.output(f"out{k}", self.live[k][0])
        return Case(f"{name} {self.dtype}", self.g.build(), self.inputs, self.weights)


# ------------------------------------------------------------------------------- checks
def tolerance(case: Case, name: str) -> tuple[float, float]:
    """(rtol, atol) for output `name`: float32 (or float64) rounding in another summation
    order, the atol scaled by the output's largest magnitude."""
    want = case.reference[name]
    scale = float(np.max(np.abs(want), initial=1.0))
    f32 = any(n.op.name == name and n.dtype.value == "f32" for n in case.graph.outputs)
    tol = 1e-4 if f32 else 1e-9
    return tol, tol * scale


def mismatch(case: Case, got: dict) -> str | None:
    """Why outputs `got` are not the reference's, or None when every one agrees."""
    for name, want in case.reference.items():
        if name not in got:
            return f"output {name!r} missing"
        have = np.asarray(got[name], dtype=np.float64)
        if have.shape != want.shape:
            return f"output {name!r} has shape {have.shape}, expected {want.shape}"
        rtol, atol = tolerance(case, name)
        if not np.allclose(have, want, rtol=rtol, atol=atol):
            err = np.abs(have - want)
            worst = np.unravel_index(int(np.nanargmax(np.where(np.isnan(err), np.inf, err))),
                                     err.shape)
            return (f"output {name!r}{list(worst)} is {have[worst]!r}, reference "
                    f"{want[worst]!r} (rtol {rtol:g}, atol {atol:g})")
    return None


def execute(case: Case, mg: MemGraph, order, check: bool = True) -> str | None:
    """Run `mg` in `order`; why its outputs are wrong, or None."""
    got = run(mg, case.inputs, case.weight_source, order=order, check=check)
    return mismatch(case, got)


def check_plan(case: Case, mg: MemGraph, seed: int, host_bytes: int | None = None) -> list[str]:
    """Every problem of a compiled plan (an empty list: it passed); `seed` draws its random
    orders."""
    try:
        if not validate(mg).proven:
            return ["validate: not proven"]
    except PlanError as exc:
        return [f"validate: {_first_line(exc)}"]
    problems = []
    if host_bytes is not None and mg.meta["host_peak_bytes"] > host_bytes:
        problems.append(f"host: the plan keeps {mg.meta['host_peak_bytes']} bytes in host "
                        f"memory, over its budget of {host_bytes}")
    tasks = sorted(n.task for n in mg.nodes if n.kind == "apply")
    if tasks != list(range(len(mg.graph.tasks))):
        problems.append(f"provenance: the applies run tasks {tasks[:8]}..., not each of "
                        f"0..{len(mg.graph.tasks) - 1} once")
    try:
        back = MemGraph.from_json(json.loads(json.dumps(mg.to_json())))
        if not validate(back).proven:
            problems.append("round trip: not proven")
    except PlanError as exc:
        return problems + [f"round trip: {_first_line(exc)}"]
    if back.to_json() != mg.to_json() or back.graph_hash != mg.graph_hash:
        problems.append("round trip: the plan read back writes another file")
    for order in ("sequential", *range(seed, seed + RANDOM_ORDERS)):
        try:
            wrong = execute(case, back, order)
        except Exception as exc:  # a failed run is a failure of the plan, whatever it raised
            wrong = f"raised {type(exc).__name__}: {_first_line(exc)}"
        if wrong:
            problems.append(f"run in order {order}: {wrong}")
    return problems


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


#: (text a BudgetError's message holds, the reason it is counted under), first match wins
REFUSALS = (("host budget", "host budget below what must stay in host memory"),
            ("staging arena", "staging arena cannot hold a block"),
            ("device arena of at least", "budget below one aligned block"),
            ("one task needs", "budget below the largest task"),
            ("resident weights need", "resident weights do not fit"),
            ("without offloading", "none: the pass does not fit without offloading"),
            ("streaming: stage", "layerwise: a layer's weights do not fit beside a task"),
            ("no contiguous room", "a task's blocks could not be placed (fragmentation)"),
            ("could not be placed", "a task's blocks could not be placed (fragmentation)"),
            ("of resident weights", "a task does not fit beside the resident weights"),
            ("inputs do not fit", "inputs do not fit"),
            ("too large to plan", "too many tasks"))


def refusal_reason(exc: BudgetError) -> str:
    """A short name for why the compiler refused a budget."""
    text = str(exc)
    return next((reason for key, reason in REFUSALS if key in text),
                "other: " + _first_line(exc)[:60])


# ------------------------------------------------------------------------------- the sweep
@dataclass
class Attempt:
    """One compile attempt: a plan (with its problems) or a refusal."""
    policy: str
    device_bytes: int
    block_bytes: int | None
    host_bytes: int | None
    refused: str | None = None
    problems: list = field(default_factory=list)
    traits: tuple = ()
    needed: int = 0        # a refusal: the budget it names


@dataclass
class GraphResult:
    index: int
    name: str
    kind: str
    tasks: int = 0            # the most tasks a plan of it has
    attempts: list = field(default_factory=list)
    error: str | None = None  # the case itself could not be built or compiled


def plan_traits(mg: MemGraph) -> tuple[str, ...]:
    """What a plan exercises: reloads, offloads, disk reads, summation chains."""
    out = [k for k in ("reload", "offload", "read") if mg.count(k)]
    if any(n.kind == "apply" and n.accumulate for n in mg.nodes):
        out.append("accumulate")
    return tuple(out)


class Sweep:
    """The compile attempts of one graph; `attempt` compiles and checks one plan."""

    def __init__(self, case: Case, seed: int, index: int, on_plan=None):
        self.case, self.seed, self.index = case, seed, index
        self.rng = np.random.default_rng([seed, index, 1])
        blocks = LLAMA_BLOCKS if case.kind == "llama" else BLOCKS
        self.block = blocks[int(self.rng.integers(len(blocks)))]
        self.result = GraphResult(index, case.name, case.kind)
        self.on_plan = on_plan  # called with (attempt, memgraph) for every plan

    def attempt(self, policy: str, budget: int, host: int | None = None) -> Attempt:
        a = Attempt(policy, budget, self.block, host)
        try:
            compiled = compile_graph(self.case.graph, CompileOptions(
                budget, policy=policy, block_bytes=self.block, host_bytes=host))
        except BudgetError as exc:
            a.refused, a.needed = refusal_reason(exc), int(exc.needed)
        except Exception as exc:  # the compiler crashed: a failure of this attempt
            a.problems = [f"compile raised {type(exc).__name__}: {_first_line(exc)}"]
        else:
            mg = compiled.memgraph
            self.result.tasks = max(self.result.tasks, len(compiled.taskgraph.tasks))
            a.problems = check_plan(self.case, mg, int(self.rng.integers(1 << 31)), host)
            if mg.device_bytes != budget:
                a.problems.append(f"the plan's arena is {mg.device_bytes} bytes, not the budget")
            a.traits = plan_traits(mg)
            if self.on_plan is not None:
                self.on_plan(a, mg)
        self.result.attempts.append(a)
        return a

    def smallest(self, policy: str) -> int | None:
        """The smallest budget that compiles for `policy`, from the one each `BudgetError`
        names (grown by an eighth where the named one fails too); None if none does."""
        budget = ALIGN
        for _ in range(PROBES):
            a = self.attempt(policy, budget)
            if a.refused is None:
                return budget
            budget = max(_aligned(a.needed), _aligned(budget * 9 // 8))
        return None

    def host_budgets(self, policy: str, budget: int) -> None:
        """Small host budgets: one far too small (refused, naming the smallest), that smallest,
        and a little more."""
        a = self.attempt(policy, budget, host=4096)
        if a.refused is not None and a.needed > 4096:
            self.attempt(policy, budget, host=a.needed)
            self.attempt(policy, budget, host=a.needed * 3 // 2)

    def run(self) -> GraphResult:
        floors = {p: self.smallest(p) for p in POLICIES}
        floor = floors["reuse-distance"]
        if floor is None:
            self.result.error = "no budget compiles with reuse-distance"
            return self.result
        generous = _aligned(4 * self.case.data_bytes)
        ladder = [floor - ALIGN, floor + ALIGN, floor * 5 // 4, floor * 8 // 5, floor * 5 // 2,
                  generous]
        for policy in POLICIES:
            for k in sorted(self.rng.choice(len(ladder), 3, replace=False)):
                self.attempt(policy, _aligned(ladder[k]))
        for policy in EVICTING:
            self.host_budgets(policy, _aligned(floor * 5 // 4))
        return self.result


def _aligned(n: int) -> int:
    return max(ALIGN, -(-int(n) // ALIGN) * ALIGN)


def sweep_graph(seed: int, index: int) -> GraphResult:
    """Every attempt for graph `index`; a graph that cannot be built (or its reference not
    evaluated) is recorded as an error of the graph."""
    try:
        case = make_case(seed, index)
    except Exception as exc:
        return GraphResult(index, "?", "?", error=f"case: {type(exc).__name__}: {_first_line(exc)}")
    return Sweep(case, seed, index).run()


def _sweep_job(job: tuple[int, int]) -> GraphResult:
    return sweep_graph(*job)


def graph_results(seed: int, count: int, workers: int) -> Iterator[GraphResult]:
    """Graph results in index order until `count` plans have been made (every graph makes
    some: `count + 100` graphs bound the sweep)."""
    jobs = ((seed, k) for k in range(count + 100))
    made = 0
    if workers <= 1:
        results = map(_sweep_job, jobs)
        pool = None
    else:
        pool = multiprocessing.get_context("fork").Pool(workers)
        results = pool.imap(_sweep_job, jobs)
    try:
        for r in results:
            yield r
            made += sum(1 for a in r.attempts if a.refused is None)
            if made >= count:
                break
    finally:
        if pool is not None:
            pool.terminate()


# ------------------------------------------------------------------------------- report
@dataclass
class Tally:
    seed: int
    graphs: int = 0
    plans: int = 0
    tasks: int = 0             # the most tasks a plan has
    by_policy: Counter = field(default_factory=Counter)
    refused_by_policy: Counter = field(default_factory=Counter)
    refusals: Counter = field(default_factory=Counter)
    traits: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    failures: list = field(default_factory=list)
    seconds: float = 0.0

    def add(self, r: GraphResult) -> None:
        self.graphs += 1
        self.tasks = max(self.tasks, r.tasks)
        self.kinds[r.kind] += 1
        where = f"bench/fuzz_plans.py --seed {self.seed} --graph {r.index}"
        if r.error:
            self.failures.append(f"{where} ({r.name}): {r.error}")
        for a in r.attempts:
            if a.refused is not None:
                self.refusals[a.refused] += 1
                self.refused_by_policy[a.policy] += 1
                continue
            self.plans += 1
            self.by_policy[a.policy] += 1
            self.traits.update(a.traits)
            for p in a.problems:
                self.failures.append(f"{where} ({r.name}) policy={a.policy} device_bytes="
                                     f"{a.device_bytes} block_bytes={a.block_bytes} "
                                     f"host_bytes={a.host_bytes}: {p}")

    def table(self) -> str:
        lines = ["| policy | plans | refused |", "| --- | ---: | ---: |"]
        for p in POLICIES:
            lines.append(f"| {p} | {self.by_policy[p]} | {self.refused_by_policy[p]} |")
        lines.append(f"| **all** | **{self.plans}** | **{sum(self.refusals.values())}** |")
        lines += ["", "| refusal (BudgetError) | count |", "| --- | ---: |"]
        lines += [f"| {k} | {v} |" for k, v in self.refusals.most_common()]
        lines += ["", "| plans with | count |", "| --- | ---: |"]
        lines += [f"| {k} | {self.traits[k]} |" for k in ("reload", "offload", "read",
                                                           "accumulate")]
        return "\n".join(lines)

    def summary(self) -> str:
        return (f"fuzz_plans: {self.plans} plans of {self.graphs} graphs ({self.kinds['random']} "
                f"random, {self.kinds['llama']} LLaMA; up to {self.tasks} tasks a plan), "
                f"{sum(self.refusals.values())} refused, "
                f"{len(self.failures)} failures, {self.seconds:.0f} s")

    def to_json(self) -> dict:
        return {"seed": self.seed, "graphs": self.graphs, "plans": self.plans,
                "most_tasks": self.tasks,
                "graph_kinds": dict(self.kinds), "plans_by_policy": dict(self.by_policy),
                "refused_by_policy": dict(self.refused_by_policy),
                "refusals": dict(self.refusals), "plans_with": dict(self.traits),
                "failures": self.failures, "seconds": round(self.seconds, 1)}


def fuzz(seed: int = 0, count: int = 10000, workers: int = 2, graph: int | None = None,
         progress: Callable[[Tally], None] | None = None) -> Tally:
    """The sweep: graphs from index 0 until `count` plans (or graph `graph` alone)."""
    tally = Tally(seed)
    t0 = time.perf_counter()
    results = ([sweep_graph(seed, graph)] if graph is not None
               else graph_results(seed, count, workers))
    for r in results:
        tally.add(r)
        if progress is not None:
            progress(tally)
    tally.seconds = time.perf_counter() - t0
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=10000, help="plans to make (default 10000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short run: 200 plans")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--graph", type=int, help="sweep this graph only (a reproducer)")
    parser.add_argument("--json", type=Path, help="write the counts and failures here")
    args = parser.parse_args(argv)
    count = 200 if args.quick else args.count
    step = max(1, count // 10)
    shown = [0]

    def progress(t: Tally) -> None:
        if t.plans >= shown[0] + step:
            shown[0] = t.plans
            print(f"  {t.plans} plans, {t.graphs} graphs, {len(t.failures)} failures",
                  file=sys.stderr, flush=True)

    tally = fuzz(args.seed, count, args.workers, args.graph, progress)
    print(tally.table())
    for f in tally.failures:
        print(f"FAIL {f}")
    print(tally.summary())
    if args.json:
        args.json.write_text(json.dumps(tally.to_json(), indent=1) + "\n")
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
