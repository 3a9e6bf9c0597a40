"""The plan report: one frozen record of what a plan needs, moves and is predicted to take.
`compile_graph` makes it for a plan it compiled; `PlanReport.of_plan` makes it for a saved one
(`einpage inspect`); `to_json` is the `--json` form and the command line prints it."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Mapping

from einpage.compiler.validator import ValidationReport
from einpage.ir.memgraph import MemGraph
from einpage.predict.simulator import Simulation


@dataclass(frozen=True, slots=True)
class Traffic:
    """Bytes a plan moves per pass. `offload_*` spills a block that is needed again (it comes
    back by a reload); `writeback_*` sends a finished output to the host, once."""
    reload_count: int
    reload_bytes: int
    offload_count: int
    offload_bytes: int
    writeback_count: int
    writeback_bytes: int

    @staticmethod
    def of(mg: MemGraph) -> "Traffic":
        final = {}
        for n in mg.nodes:
            if n.kind == "offload":
                final[n.tensor] = n.id
        at_host = {o.tensor for o in mg.outputs if o.at == "host"}
        back = {final[t] for t in at_host if t in final}
        spills = [n for n in mg.nodes if n.kind == "offload" and n.id not in back]
        return Traffic(mg.count("reload"), mg.moved_bytes("reload"), len(spills),
                       sum(mg.tensors[n.tensor].bytes for n in spills), len(back),
                       sum(mg.tensors[mg.nodes[i].tensor].bytes for i in back))


@dataclass(frozen=True, slots=True)
class TrialSummary:
    """One lowering the compiler tried (look-ahead window, resident weights), and its result."""
    lookahead: str
    makespan_s: float
    resident_bytes: int
    live_peak_bytes: int


@dataclass(frozen=True, slots=True)
class CompileFigures:
    """What only the compiler knows: the taskgraph, the pass's needs, the search."""
    tasks: int
    blocks: int
    lower_bound_bytes: int        # resident weights and KV + the largest task's working set
    min_budget_bytes: int         # the largest task's working set
    weight_bytes: int
    resident_bytes: int           # weights kept on the device for every pass
    streamed_weight_bytes: int
    kv_bytes: int                 # the KV store the pass reads (0 for a prefill)
    kv_resident_bytes: int        # ... of which stays on the device across passes
    kv_streamed_bytes: int        # ... of which streams in each pass
    min_stream_bytes: int         # weights + KV - budget: what no plan can keep resident
    activation_peak_bytes: int
    compile_seconds: float
    tasks_per_second: float | None
    lookahead: str
    trials: tuple[TrialSummary, ...] = ()


@dataclass(frozen=True)
class PlanReport:
    device_bytes: int
    nodes: int
    tensors: int
    peak_bytes: int
    live_peak_bytes: int | None
    traffic: Traffic
    simulation: Simulation
    tokens: int | None = None                      # tokens per pass, for tokens/s
    compiled: CompileFigures | None = None         # None for a plan read from a file
    workload: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))
    notes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @staticmethod
    def of_plan(mg: MemGraph, valid: ValidationReport | None, simulation: Simulation,
                compiled: CompileFigures | None = None) -> "PlanReport":
        """The report of `mg` (its `meta` is the workload), validated and simulated."""
        tokens = mg.meta.get("tokens")
        return PlanReport(mg.device_bytes, len(mg.nodes), len(mg.tensors),
                          valid.peak_bytes if valid else mg.high_water(),
                          valid.live_peak_bytes if valid else None, Traffic.of(mg), simulation,
                          tokens if isinstance(tokens, int) else None, compiled,
                          MappingProxyType(dict(mg.meta)))

    def with_notes(self, **notes: str) -> "PlanReport":
        """Where outputs were written, warnings: shown after the figures."""
        return replace(self, notes=MappingProxyType({**self.notes, **notes}))

    @property
    def tokens_per_s(self) -> float | None:
        s = self.simulation.makespan_s
        return self.tokens / s if self.tokens and s > 0 else None

    def to_json(self) -> dict:
        """The flat `--json` object: the workload, the plan, what it moves, the prediction,
        the compiler's figures (when compiled), the notes."""
        sim = self.simulation
        out: dict = dict(self.workload)
        out.update(device_bytes=self.device_bytes, nodes=self.nodes, tensors=self.tensors,
                   peak_bytes=self.peak_bytes, live_peak_bytes=self.live_peak_bytes)
        out.update({f.name: getattr(self.traffic, f.name) for f in fields(Traffic)})
        out.update(device=sim.device, makespan_s=sim.makespan_s, compute_s=sim.compute_s,
                   h2d_s=sim.h2d_s, d2h_s=sim.d2h_s, stall_s=sim.stall_s,
                   stall_h2d_s=sim.stall_h2d_s, late_reloads=sim.late_reloads,
                   lower_bound_s=sim.lower_bound_s, efficiency=round(sim.efficiency, 4),
                   h2d_bytes=sim.h2d_bytes, h2d_min_bytes=sim.h2d_min_bytes,
                   d2h_bytes=sim.d2h_bytes)
        if self.tokens:
            out["tokens_per_s"] = self.tokens_per_s
        if self.compiled is not None:
            c = self.compiled
            out.update({f.name: getattr(c, f.name) for f in fields(CompileFigures)
                        if f.name != "trials"})
            if c.trials:
                out["trials"] = [{f.name: getattr(t, f.name) for f in fields(TrialSummary)}
                                 for t in c.trials]
        out.update(self.notes)
        return out
