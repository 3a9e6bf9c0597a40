"""Lowerings ahead in forked processes (`einpage.compiler.ahead`): the same plans whatever
`jobs` is, children that fail stand for nothing, and none outlives its search."""
from __future__ import annotations

import dataclasses
import os
import sys
import threading

import pytest

from einpage.compiler import CompileOptions, ahead, compile_graph, search
from einpage.compiler.tiers import host_needs
from einpage.models import config, llama

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="lowerings ahead fork: Linux only")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_child_computes_what_it_is_given_and_a_failed_one_is_missing():
    runner = ahead.Ahead(2)
    runner.start("sum", lambda: sum(range(10)))
    runner.start("boom", lambda: 1 / 0)
    runner.start("third", lambda: 3)  # no child free: not started
    assert runner.running("sum") and runner.running("boom") and not runner.running("third")
    assert runner.take("sum") == 45
    assert not ahead.taken(runner.take("boom"))      # it raised: as if never started
    assert not ahead.taken(runner.take("third"))
    assert not ahead.taken(runner.take("sum"))       # taken once


def test_cancelled_and_leftover_children_are_killed_and_reaped():
    runner = ahead.Ahead(3)
    forever = threading.Event().wait  # (never set: the child blocks until killed)
    runner.start(("a", 1), forever)
    runner.start(("b", 2), forever)
    pids = {k: c.pid for k, c in runner._running.items()}
    runner.cancel(lambda k: k[0] == "a")
    assert not runner.running(("a", 1)) and runner.running(("b", 2))
    assert _gone(pids[("a", 1)])
    runner.close()
    assert _gone(pids[("b", 2)]) and not runner.running(("b", 2))


def test_lowering_ahead_only_where_it_pays_and_is_safe():
    assert ahead.active(10 ** 6) is None                 # none under way
    with ahead.lowering_ahead(1):
        assert ahead.active(10 ** 6) is None             # one job: the parent's
    with ahead.lowering_ahead(3):
        runner = ahead.active(10 ** 6)
        assert runner is not None and runner.jobs == 3
        assert ahead.active(ahead.MIN_TASKS - 1) is None  # a small graph: not worth a fork
        with ahead.lowering_ahead(2):
            assert ahead.active(10 ** 6) is runner       # the outer one serves
        stop = threading.Event()
        other = threading.Thread(target=stop.wait)
        other.start()
        try:
            assert ahead.active(10 ** 6) is None         # a fork would copy its locks
        finally:
            stop.set()
            other.join()
    assert ahead.active(10 ** 6) is None


def _small_streaming():
    cfg = dataclasses.replace(config.preset("small"), kv_heads=8)
    return cfg, llama.prefill_graph(cfg).bind(B=1, S=128)


def _same(a, b) -> None:
    assert a.memgraph.nodes == b.memgraph.nodes
    assert a.memgraph.meta == b.memgraph.meta
    assert a.simulation.makespan_s == b.simulation.makespan_s
    timed = ("compile_seconds", "tasks_per_second")  # (the compile's own speed)
    assert ({k: v for k, v in a.report.to_json().items() if k not in timed}
            == {k: v for k, v in b.report.to_json().items() if k not in timed})


@pytest.mark.parametrize("host", [False, True], ids=["device", "disk tier"])
def test_the_plan_is_the_same_whatever_the_jobs(monkeypatch, host):
    """A small llama at half its weights, streaming (its room climbed on the device) and, with
    a host for half of what streams, read from disk (its room climbed again by the tiered pass,
    `tier_room.climb_tiered`): compiled one lowering at a time and with three lowered ahead,
    the same plan, figures and report; and children did lower ahead."""
    monkeypatch.setattr(ahead, "MIN_TASKS", 0)
    cfg, graph = _small_streaming()
    options = CompileOptions(cfg.weight_bytes() // 2)
    if host:
        free = compile_graph(graph, options).memgraph
        needs = host_needs(free)
        largest = max(free.tensors[t].bytes for t in needs.streamed)
        options = dataclasses.replace(options, host_bytes=needs.fixed_bytes + 2 * largest
                                      + needs.streamed_bytes // 2)
    serial = compile_graph(graph, options)
    started = []
    start = ahead.Ahead.start

    def counted(self, key, work):
        before = len(self._running)
        start(self, key, work)
        if len(self._running) > before:  # (a tiered climb's keys are resident sets)
            started.append("tiered" if isinstance(key[1], frozenset) else "device")

    monkeypatch.setattr(ahead.Ahead, "start", counted)
    parallel = compile_graph(graph, dataclasses.replace(options, jobs=3))
    _same(serial, parallel)
    assert started.count("device") >= 3
    if host:
        assert parallel.simulation.disk_bytes > 0 and started.count("tiered") >= 3


def test_children_that_fail_leave_the_plan_as_it_was(monkeypatch):
    """Every child's lowering fails (here: raises): the parent lowers each point itself, the
    same plan."""
    monkeypatch.setattr(ahead, "MIN_TASKS", 0)
    cfg, graph = _small_streaming()
    options = CompileOptions(cfg.weight_bytes() // 2)
    serial = compile_graph(graph, options)
    parent = os.getpid()
    figures = search.Trials._figures

    def broken(self, key):
        if os.getpid() != parent:
            raise RuntimeError("a child fails")
        return figures(self, key)

    monkeypatch.setattr(search.Trials, "_figures", broken)
    _same(serial, compile_graph(graph, dataclasses.replace(options, jobs=2)))


def test_jobs_on_the_command_line(capsys):
    from einpage.cli.main import main
    for bad in ("0", "two"):
        with pytest.raises(SystemExit) as err:
            main(["compile", "tiny", "--gpu-mem", "1GB", "--jobs", bad])
        assert err.value.code == 2
        assert "--jobs" in capsys.readouterr().err
