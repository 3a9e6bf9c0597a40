"""`--timing`: each measured pass next to its prediction, figure by figure — wall time, busy time
per queue, compute stall, bytes and achieved rate each way, and how much of the h2d queue's time
hid behind compute."""
from __future__ import annotations

from einpage.units import format_size


NO_PREDICTION = ("  (no prediction: pass --device-file PROFILE, e.g. from "
                 "`einpage calibrate -o cpu.json`, or --device NAME)")


def _secs(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.3f} s" if s >= 0.1 else f"{s * 1e3:.2f} ms"


def _rate(nbytes: int, seconds: float) -> str:
    return f"{format_size(nbytes / seconds)}/s" if seconds > 0 and nbytes else "-"


def print_measured(m, sim, title: str = "pass") -> None:
    """One pass: `m` a `Measured`, `sim` the `Simulation` of the same plan or None."""
    have = bool(m.spans)
    how = (" (one CUDA graph launch: wall only)" if m.replayed else
           " (captured as a CUDA graph, then launched: wall only)" if m.captured else "")
    print(f"{title} on {m.backend}{how}: measured"
          + (f" | predicted on {sim.device}" if sim else ""))
    rows = [("wall", m.wall_s, sim.makespan_s if sim else None)]
    if have:
        rows += [("compute busy", m.busy_s("compute"), sim.compute_s if sim else None),
                 ("compute stall", m.compute_stall_s, sim.stall_s if sim else None),
                 ("h2d busy", m.busy_s("h2d"), sim.h2d_s if sim else None),
                 ("d2h busy", m.busy_s("d2h"), sim.d2h_s if sim else None)]
        if m.bytes("disk") or (sim and sim.disk_bytes):
            rows.append(("disk busy", m.busy_s("disk"), sim.disk_s if sim else None))
    for label, got, want in rows:
        ratio = f"  ({got / want:.2f}x)" if want else ""
        print(f"  {label:<14} {_secs(got):>10} | {_secs(want):>10}{ratio}")
    if have:
        for q in ("h2d", "d2h", "disk"):
            nbytes = m.bytes(q)
            pred = {"h2d": sim.h2d_bytes, "d2h": sim.d2h_bytes,
                    "disk": sim.disk_bytes}[q] if sim else None
            if q == "disk" and not nbytes and not pred:
                continue
            print(f"  {q + ' bytes':<14} {format_size(nbytes):>10} | "
                  f"{format_size(pred) if pred is not None else '-':>10}   achieved "
                  f"{_rate(nbytes, m.busy_s(q))}")
        if m.bytes("h2d"):
            print(f"  h2d hidden behind compute: {m.hidden_fraction('h2d'):.0%}")
    if m.load_bytes:
        print(f"  before the pass: {format_size(m.load_bytes)} of resident weights loaded in "
              f"{_secs(m.load_s)}")
    if m.compile_s:
        print(f"  before the pass: kernels compiled in {_secs(m.compile_s)} (once per plan)")


def print_repeated(passes) -> None:
    """The passes of one plan run `--passes N` times in one session: the first (what a single
    run measures: cold caches, first launches) and the median of the others (for an even count
    the lower one: a pass that ran), each next to the prediction, then the spread."""
    n = len(passes)
    _, measured, sim = passes[0]
    print_measured(measured, sim, f"pass 1 of {n} (the first)")
    later = passes[1:]
    # the pass that captured the CUDA graph also issued it: shown apart, the median of the rest
    capture = next((k + 2 for k, p in enumerate(later) if p[1].captured), None)
    rest = sorted((p for p in later if not p[1].captured), key=lambda p: p[1].wall_s)
    if capture is not None:
        print_measured(later[capture - 2][1], later[capture - 2][2], f"pass {capture} of {n}")
        what = f"median of the {len(rest)} replays" if len(rest) > 1 else "the replay"
        title = f"{what} (pass {capture} captured the graph)"
        spread = "replays"
    else:
        title = "pass 2 of 2" if n == 2 else f"median of passes 2-{n}"
        spread = f"passes 2-{n}"
    if rest:
        _, median, sim = rest[(len(rest) - 1) // 2]
        print_measured(median, sim, title)
    if len(rest) > 1:
        walls = [p[1].wall_s for p in rest]
        print(f"  {spread} wall: min {_secs(walls[0])}, median {_secs(median.wall_s)}, "
              f"max {_secs(walls[-1])}")
    if sim is None:
        print(NO_PREDICTION)


def print_timing(passes, first: str = "prefill pass", later: str = "decode step") -> None:
    """Every pass of a run (`first`, then the `later` ones: decode steps, or verify passes):
    (memgraph, Measured, Simulation or None) each; the prediction is there where a profile was
    given (`--device` / `--device-file`)."""
    for k, (_, measured, sim) in enumerate(passes):
        print_measured(measured, sim, first if k == 0 else f"{later} {k}")
    if passes and all(sim is None for _, _, sim in passes):
        print(NO_PREDICTION)


def print_ranks_timing(passes, profile, first: str = "prefill pass",
                       later: str = "decode step", offset: int = 0,
                       micro_batches: int = 1) -> None:
    """Every pass of a run on several devices (`runners.RanksPass`): the pass's wall (its
    slowest rank), then each rank's figures next to its part of the programs simulated
    together on `profile` (None: measured only); one simulation per set of programs. The passes
    after the first are `later` k + `offset` (`offset` 1: one plan's passes, numbered 2, 3, ...).
    With `micro_batches` M > 1 a pass is M passes of each rank in a row: the ranks' wall is set
    beside their M simulated passes together, each rank's figures measured only."""
    from einpage.predict.simulator import simulate_ranks
    sims: dict[int, object] = {}
    for k, p in enumerate(passes):
        title = first if k == 0 else f"{later} {k + offset}"
        sim = None
        if profile is not None:
            if id(p.programs) not in sims:
                sims[id(p.programs)] = simulate_ranks(p.programs, [profile] * len(p.programs),
                                                      micro_batches)
            sim = sims[id(p.programs)]
        wall = max(m.wall_s for m in p.measured.values())
        print(f"{title} on {len(p.programs)} devices: measured {_secs(wall)} (the slowest rank)"
              + (f" | predicted {_secs(sim.makespan_s)} on {profile.name} "
                 f"({wall / sim.makespan_s:.2f}x)" if sim else ""))
        for r in sorted(p.measured):
            print_measured(p.measured[r], sim.passes[r][0] if sim and micro_batches == 1
                           else None, f"  {title}, rank {r}")
    if passes and profile is None:
        print(NO_PREDICTION)
