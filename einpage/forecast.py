"""A whole generation, predicted: the prefill plan of the prompt, then one decode plan per KV-store
bucket, each compiled for the budget and simulated on the profile, and the steps each bucket
runs. This is what `einpage compile --max-new-tokens N` reports and what the generation
benchmarks measure; no weights and no GPU are needed."""
from __future__ import annotations

from dataclasses import dataclass, replace

from einpage.compiler import CompileOptions, Compiled, compile_graph
from einpage.errors import BudgetError, InputError, PlanError, named
from einpage.models import llama, schema
from einpage.models.config import LlamaConfig
from einpage.models.kvstore import GRANULE, bucket_steps
from einpage.models.speculative import expected_tokens
from einpage.predict import DEFAULT_DEVICE, get_device
from einpage.units import format_size


@dataclass(frozen=True)
class BucketPlan:
    """The decode plan of one KV-store capacity and the steps that run it."""
    capacity: int
    steps: int
    compiled: Compiled
    h2d_bandwidth: float   # of the profile it was predicted on

    @property
    def step_s(self) -> float:
        return self.compiled.simulation.makespan_s

    @property
    def step_bytes(self) -> int:
        """Bytes one step moves across the host link, both ways."""
        sim = self.compiled.simulation
        return sim.h2d_bytes + sim.d2h_bytes

    @property
    def bound_s(self) -> float:
        """The step's lower bound: its compute, or the bytes no plan can keep on the device
        (`CompileFigures.min_stream_bytes`: weights + KV + activations at their peak - budget)
        over the host->device bandwidth, each of the fewest copies at the link's latency (the
        report's stream term, `ProblemBound.stream_s`), whichever is more."""
        sim, report = self.compiled.simulation, self.compiled.report
        stream = (report.bound.stream_s if report.bound is not None
                  else report.compiled.min_stream_bytes / self.h2d_bandwidth)
        return max(sim.compute_s, stream)

    @property
    def efficiency(self) -> float:
        return self.bound_s / self.step_s if self.step_s > 0 else 1.0


@dataclass(frozen=True)
class GenerationForecast:
    model: str
    batch: int
    prompt: int
    new_tokens: int
    prefill: Compiled
    buckets: tuple[BucketPlan, ...]

    @property
    def plans(self) -> int:
        return 1 + len(self.buckets)

    @property
    def prefill_s(self) -> float:
        return self.prefill.simulation.makespan_s

    @property
    def decode_s(self) -> float:
        return sum(b.steps * b.step_s for b in self.buckets)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the whole generation (FlexGen's throughput)."""
        return self.batch * self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        steps = sum(b.steps for b in self.buckets)
        return self.batch * steps / self.decode_s if self.decode_s > 0 else None

    def to_json(self) -> dict:
        return {
            "model": self.model, "batch": self.batch, "prompt": self.prompt,
            "new_tokens": self.new_tokens, "plans": self.plans, "prefill_s": self.prefill_s,
            "decode_s": self.decode_s, "total_s": self.total_s,
            "tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
            "device": self.prefill.simulation.device,
            "device_bytes": self.prefill.memgraph.device_bytes,
            "buckets": [{
                "capacity": b.capacity, "steps": b.steps, "step_s": b.step_s,
                "step_bytes": b.step_bytes, "bound_s": b.bound_s,
                "efficiency": round(b.efficiency, 4),
                "kv_bytes": b.compiled.report.compiled.kv_bytes,
                "kv_resident_bytes": b.compiled.report.compiled.kv_resident_bytes,
                "weight_resident_bytes": b.compiled.report.compiled.resident_bytes,
                "min_stream_bytes": b.compiled.report.compiled.min_stream_bytes,
                "compile_s": b.compiled.report.compiled.compile_seconds,
            } for b in self.buckets],
        }


def forecast_generation(cfg: LlamaConfig, batch: int, prompt: int, new_tokens: int,
                        options: CompileOptions, granule: int = GRANULE) -> GenerationForecast:
    """Compile and simulate the prefill of `prompt` tokens and every decode bucket of
    `new_tokens` greedy tokens for `batch` rows under `options` (its budget and profile)."""
    if batch < 1 or prompt < 1 or new_tokens < 1:
        raise InputError(f"a generation needs batch, prompt and new tokens of at least 1, got "
                         f"{batch}, {prompt} and {new_tokens}")
    sources = {name: schema.hf_tensor(name) for name in schema.weight_shapes(cfg)}
    base = {"model": cfg.name, "batch": batch, "dtype": cfg.dtype.value}

    def compile_for(graph, **workload) -> Compiled:
        return compile_graph(graph, replace(options, sources=sources,
                                            workload={**base, **workload}))

    # the prefill a generation runs: logits at each row's last position only
    pre = compile_for(llama.prefill_graph(cfg, last=True).bind(B=batch, S=prompt),
                      phase="prefill",
                      seq=prompt, tokens=batch * prompt)
    step = llama.decode_graph(cfg)
    bandwidth = (options.device or get_device(DEFAULT_DEVICE)).h2d_bandwidth
    buckets = tuple(BucketPlan(cap, steps, compile_for(
        step.bind(B=batch, C=cap), phase="decode", seq=1, capacity=cap, tokens=batch), bandwidth)
        for cap, steps in bucket_steps(prompt, new_tokens, granule, cfg.kv_ring))
    return GenerationForecast(cfg.name, batch, prompt, new_tokens, pre, buckets)


@dataclass(frozen=True)
class PricedStep:
    """A step's plan and its prediction: one device's (`plan` a `Compiled`) or several devices'
    (a `ParallelPlan`, its ranks simulated together; `h2d_bytes` summed over the ranks,
    `device_bytes` each device's budget)."""
    plan: object
    seconds: float
    h2d_bytes: int
    device: str
    device_bytes: int
    devices: int = 1


def priced(plan, profile) -> PricedStep:
    """`plan` (a `Compiled`, or a `ParallelPlan` simulated on `profile`) with its prediction."""
    if isinstance(plan, Compiled):
        sim = plan.simulation
        return PricedStep(plan, sim.makespan_s, sim.h2d_bytes, sim.device,
                          plan.memgraph.device_bytes)
    from einpage.predict.simulator import simulate_ranks
    sim = simulate_ranks(plan.programs, [profile] * plan.world)
    return PricedStep(plan, sim.makespan_s, sum(p[0].h2d_bytes for p in sim.passes),
                      profile.name, plan.programs[0].device_bytes, plan.world)


@dataclass(frozen=True)
class VerifyPlan:
    """The verify plan of `k` proposals per row (T = k + 1 tokens) and what it yields."""
    k: int
    step: PricedStep
    tokens_per_pass: float   # per row, at the forecast's acceptance

    @property
    def pass_s(self) -> float:
        return self.step.seconds


@dataclass(frozen=True)
class SpeculationForecast:
    """Decode at one position, plain against verify passes of k = 1.. proposals at an
    acceptance per proposal: tokens/s of each, and the k with the most. With a draft model
    (`draft`: its decode step, planned for `draft_bytes` of the budget, the model's plans for
    the rest; on several devices, each device's share of its budget) a pass is k + 1 draft
    steps and then the verify pass; prompt lookup costs nothing."""
    model: str
    batch: int
    capacity: int
    acceptance: float
    plain: PricedStep
    verify: tuple[VerifyPlan, ...]
    draft: PricedStep | None = None
    draft_bytes: int = 0
    draft_name: str = "ngram"

    @property
    def plain_tokens_per_s(self) -> float:
        s = self.plain.seconds
        return self.batch / s if s > 0 else 0.0

    @property
    def draft_step_s(self) -> float:
        return self.draft.seconds if self.draft is not None else 0.0

    @property
    def parallel(self) -> str | None:
        """How the steps are spread over several devices (None: one device)."""
        if self.plain.devices == 1:
            return None
        return self.plain.plan.programs[0].meta.get("parallel", "pipeline")

    def pass_s(self, v: VerifyPlan) -> float:
        """One pass: the draft's k + 1 steps, then the verify pass."""
        return (v.k + 1) * self.draft_step_s + v.pass_s

    def tokens_per_s(self, v: VerifyPlan) -> float:
        s = self.pass_s(v)
        return self.batch * v.tokens_per_pass / s if s > 0 else 0.0

    @property
    def best(self) -> VerifyPlan:
        return max(self.verify, key=lambda v: (self.tokens_per_s(v), -v.k))

    def to_json(self) -> dict:
        return {"model": self.model, "batch": self.batch, "capacity": self.capacity,
                "acceptance": self.acceptance, "draft": self.draft_name,
                "draft_bytes": self.draft_bytes, "draft_step_s": self.draft_step_s,
                "device": self.plain.device, "device_bytes": self.plain.device_bytes,
                "devices": self.plain.devices, "parallel": self.parallel,
                "plain_step_s": self.plain.seconds,
                "plain_tokens_per_s": self.plain_tokens_per_s,
                "verify": [{"k": v.k, "pass_s": self.pass_s(v), "verify_s": v.pass_s,
                            "tokens_per_pass": v.tokens_per_pass,
                            "tokens_per_s": self.tokens_per_s(v),
                            "speedup": self.tokens_per_s(v) / self.plain_tokens_per_s
                            if self.plain_tokens_per_s else None,
                            "h2d_bytes": v.step.h2d_bytes}
                           for v in self.verify],
                "k": self.best.k, "tokens_per_s": self.tokens_per_s(self.best)}


def forecast_speculation(cfg: LlamaConfig, batch: int, capacity: int, acceptance: float,
                         ks: tuple[int, ...], options: CompileOptions,
                         workload: dict | None = None, draft: LlamaConfig | None = None,
                         draft_bytes: int = 0, plain: PricedStep | None = None,
                         devices: int = 1, parallel: str = "pipeline") -> SpeculationForecast:
    """Compile and simulate the plain decode step and the verify step of each `k` in `ks` over
    a store of `capacity` slots for `batch` rows under `options`; with a `draft` model, its
    decode step for `draft_bytes` and the verify steps for the rest of the budget (the plain
    step keeps the whole of it; `plain`: that step, compiled already). On `devices` > 1 every
    step is a plan for that many devices of `options.device_bytes` each (`draft_bytes`: each
    device's share), spread as `parallel` says (`compiler.parallel`) for the plain step, and
    then as the plain step was: the verify steps on its stage cut (a layer's KV rows stay on
    its rank), the draft model split the same way."""
    from einpage.compiler.parallel import compile_parallel
    if not 0.0 <= acceptance <= 1.0:
        raise InputError(f"--acceptance must be between 0 and 1, got {acceptance}")
    if not ks or min(ks) < 1:
        raise InputError(f"draft tokens must be at least 1, got {list(ks)}")
    profile = options.device or get_device(DEFAULT_DEVICE)
    sources = {name: schema.hf_tensor(name) for name in schema.weight_shapes(cfg)}
    base = {"model": cfg.name, "batch": batch, "dtype": cfg.dtype.value, "capacity": capacity,
            **(workload or {})}
    spread = {"parallel": parallel, "cut": None, "group": None}

    def step(graph, opts: CompileOptions) -> PricedStep:
        if devices == 1:
            return priced(compile_graph(graph, opts), profile)
        return priced(compile_parallel(graph, devices, opts, spread["parallel"],
                                       cut=spread["cut"], group=spread["group"]), profile)

    def compile_for(graph, **more) -> PricedStep:
        return step(graph, replace(options, sources=sources, workload={**base, **more}))

    if plain is None:
        plain = compile_for(llama.decode_graph(cfg).bind(B=batch, C=capacity), phase="decode",
                            seq=1, tokens=batch)
    if devices > 1:  # the verify steps and the draft spread as the plain step is
        spread["parallel"] = plain.plan.programs[0].meta.get("parallel", "pipeline")
        spread["group"] = plain.plan.programs[0].meta.get("group")
    drafted = None
    if draft is not None:
        if options.device_bytes is not None and draft_bytes >= options.device_bytes:
            raise InputError(f"the draft takes {format_size(draft_bytes)} of the "
                             f"{format_size(options.device_bytes)} budget: no room is left for "
                             "the model (a larger --gpu-mem, or a smaller --draft-gpu-mem)")
        try:
            drafted = step(
                llama.decode_graph(draft).bind(B=batch, C=capacity + max(ks) + 1),
                replace(options, device_bytes=draft_bytes or None,
                        sources={n: schema.hf_tensor(n) for n in schema.weight_shapes(draft)},
                        workload={"model": draft.name, "batch": batch, "phase": "decode",
                                  "role": "draft", "tokens": batch}))
        except (PlanError, BudgetError) as exc:
            raise named(exc, f"the draft model {draft.name}") from None
        if options.device_bytes is not None:
            options = replace(options, device_bytes=options.device_bytes - draft_bytes)
    if devices > 1:
        spread["cut"] = getattr(plain.plan.split, "cut", None)
    verify = llama.verify_graph(cfg)
    plans = tuple(VerifyPlan(k, compile_for(verify.bind(B=batch, C=capacity, T=k + 1),
                                            phase="verify", seq=k + 1, tokens=batch * (k + 1)),
                             expected_tokens(k, acceptance)) for k in ks)
    return SpeculationForecast(cfg.name, batch, capacity, acceptance, plain, plans, drafted,
                               draft_bytes, "ngram" if draft is None else draft.name)


#: the draft's shares of the budget the split search also tries, as multiples of its weights
#: and KV store (the default share is `speculative.draft_bytes`: 1.25x)
DRAFT_SHARES = (1.1, 1.02)


def search_draft_split(cfg: LlamaConfig, batch: int, capacity: int, acceptance: float,
                       ks: tuple[int, ...], options: CompileOptions, workload: dict,
                       draft: LlamaConfig, devices: int = 1, parallel: str = "pipeline"
                       ) -> tuple[SpeculationForecast, list[tuple[int, float]]]:
    """The split of the budget between a draft model and the model, by simulated step time:
    every k at the largest share that leaves the model room (the default,
    `speculative.draft_bytes`: 1.25x the draft's weights and KV store, else the next of
    `DRAFT_SHARES`), then the k it picks at the smaller shares; the forecast of the fastest,
    and `(draft bytes, tokens/s)` of each share tried. On `devices` > 1 the shares are each
    device's (the draft's weights and KV store over the devices) and every step is planned
    for the devices (`forecast_speculation`)."""
    from einpage.models.speculative import draft_bytes
    default = draft_bytes(draft, batch, capacity + max(ks) + 1) // devices
    need = default / 1.25
    sizes = [default] + [int(share * need) for share in DRAFT_SHARES]
    if options.device_bytes is not None:
        sizes = [b for b in sizes if b < options.device_bytes]
        if not sizes:
            each = f" of each of {devices} devices" if devices > 1 else ""
            raise InputError(f"the draft needs {format_size(int(need))} (its weights and KV "
                             f"store{', split' if devices > 1 else ''}) of the "
                             f"{format_size(options.device_bytes)} budget{each}: no room is "
                             "left for the model (a larger --gpu-mem)")
    else:
        sizes = sizes[:1]
    first = forecast_speculation(cfg, batch, capacity, acceptance, ks, options, workload, draft,
                                 sizes[0], devices=devices, parallel=parallel)
    best, tried = first, [(sizes[0], first.tokens_per_s(first.best))]
    for size in sizes[1:]:
        other = forecast_speculation(cfg, batch, capacity, acceptance, (first.best.k,),
                                     options, workload, draft, size, plain=first.plain,
                                     devices=devices, parallel=parallel)
        rate = other.tokens_per_s(other.best)
        tried.append((size, rate))
        if rate > best.tokens_per_s(best.best):
            best = other
    return best, tried
