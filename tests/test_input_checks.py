"""Input that is checked, not ignored (issue 16): device files as `einpage devices --json` prints
them, the Python API's typed errors, random weights made block by block, a saved plan run only
with the checkpoint it was made for, and a command line whose every option says what it does.
The command line's refusals themselves are catalogued in `test_catalogue.py`."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from checkpoints import write_checkpoint
from test_cli import assert_one_line_error, cli

from einpage import __version__
from einpage.cli.main import build_parser
from einpage.errors import CheckpointError, GraphError, InputError, SpecError
from einpage.ir import GraphBuilder, scalar
from einpage.models.checkpoint import RandomArray, RandomWeights
from einpage.predict import PROFILES, load_device_file

# ------------------------------------------------------------------ device files


@pytest.fixture
def devices_json(tmp_path, capsys):
    """What `einpage devices --json` prints, saved."""
    assert cli("devices", "--json") == 0
    path = tmp_path / "devices.json"
    path.write_text(capsys.readouterr().out)
    return path


def test_device_file_takes_what_devices_json_prints(devices_json):
    for name, profile in PROFILES.items():
        assert load_device_file(devices_json, name) == profile
    with pytest.raises(InputError, match=f"holds {len(PROFILES)} profiles: pick one with "
                                         "--device"):
        load_device_file(devices_json)
    with pytest.raises(InputError, match="no profile 'h100'; it holds h100-pcie"):
        load_device_file(devices_json, "h100")


def test_device_file_as_a_list_or_one_profile(tmp_path):
    t4 = PROFILES["t4"].to_json()
    path = tmp_path / "p.json"
    path.write_text(json.dumps([t4, PROFILES["v100"].to_json()]))
    assert load_device_file(path, "t4") == PROFILES["t4"]
    path.write_text(json.dumps([t4]))
    assert load_device_file(path) == PROFILES["t4"]  # the only one
    path.write_text(json.dumps({"t4": t4}))
    assert load_device_file(path) == PROFILES["t4"]
    path.write_text(json.dumps(t4))
    assert load_device_file(path, "t4") == load_device_file(path) == PROFILES["t4"]
    with pytest.raises(InputError, match="the profile is 't4', not --device 'v100'"):
        load_device_file(path, "v100")


def test_graph_launch_overhead_round_trips_and_prices_replayed_passes(tmp_path):
    """A profile's `graph_launch_overhead` (what calibrate measures on cupy) survives the file;
    `replayed()` prices a kernel at it; a profile without one prices replays as issued."""
    from dataclasses import replace
    h100 = PROFILES["h100-pcie"]
    assert h100.graph_launch_overhead is None and h100.replayed() is h100
    timed = replace(h100, graph_launch_overhead=2e-6)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(timed.to_json()))
    loaded = load_device_file(path)
    assert loaded == timed and loaded.replayed().launch_overhead == 2e-6
    path.write_text(json.dumps(dict(timed.to_json(), graph_launch_overhead=-1)))
    with pytest.raises(InputError, match="graph_launch_overhead"):
        load_device_file(path)


def test_compile_picks_the_device_from_a_file_of_several(devices_json, capsys):
    assert cli("compile", "tiny", "--gpu-mem", "1MB", "--seq", "4", "--device-file",
               devices_json, "--device", "t4", "--json") == 0
    assert json.loads(capsys.readouterr().out)["device"] == "t4"


def test_budget_above_the_device_needs_force(capsys):
    code = cli("compile", "tiny", "--gpu-mem", "200GB", "--device", "t4", "--seq", "4")
    assert_one_line_error(capsys, code, "--gpu-mem 200.00 GB is more than the 16.00 GB of the "
                                        "device t4: pick a --device that has it, or add --force")
    assert cli("compile", "tiny", "--gpu-mem", "200GB", "--device", "t4", "--seq", "4",
               "--force", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert "more than the 16.00 GB of the device t4" in json.dumps(report)


# ------------------------------------------------------------------ decode options


def test_decode_step_defaults_to_the_step_after_the_default_prefill(capsys):
    assert cli("compile", "tiny", "--gpu-mem", "1MB", "--phase", "decode", "--json") == 0
    assert json.loads(capsys.readouterr().out)["past"] == 2048


# ------------------------------------------------------------------ the Python API


def _x(g):
    return g.input("x", (4, 8), "f32")


@pytest.mark.parametrize("build, error, message", [
    (lambda g: g.einsum("ab,ab->ab", _x(g), g.input("y", (4, 8)), join=lambda v: v),
     SpecError, r"einsum ab,ab->ab: the join takes arguments \(v\), but the einsum has 2 "
                r"operand\(s\): it must take 2"),
    (lambda g: g.einsum("ab->ab", _x(g), join=lambda a, b: a * b), SpecError,
     r"the join takes arguments \(a, b\), but the einsum has 1"),
    (lambda g: g.einsum("ab->ab", _x(g), join=lambda v: np.exp(v)), SpecError,
     "the join must build a SymPy expression .* not NumPy's"),
    (lambda g: g.einsum("ab->ab", _x(g), join=lambda v: np.float32(2)), SpecError,
     "the join returned a NumPy float32"),
    (lambda g: g.einsum("ab->ab", _x(g), join=lambda v: None), SpecError,
     "the join returned NoneType None, not a SymPy expression"),
    (lambda g: g.einsum("ab,ab->ab", _x(g), 3.0), GraphError,
     r"einsum ab,ab->ab: operand 1 \(float 3.0\) is not a tensor of this graph"),
    (lambda g: g.einsum("ab,ab->ab", _x(g), np.ones((4, 8))), GraphError,
     r"operand 1 \(ndarray array\(\[\[1\., .*\) is not a tensor"),
    (lambda g: g.gather(_x(g), [1, 2]), GraphError, r"gather: operand 1 \(list"),
    (lambda g: g.output("y", "x"), GraphError, r"output 'y': operand 0 \(str 'x'\)"),
    (lambda g: g.einsum("ab->a", _x(g), join=lambda v: v * v), SpecError,
     "einsum ab->a contracts b with a join of its own: name the aggregation"),
    (lambda g: (_x(g), g.build()), GraphError, "build: the graph has no output"),
    (lambda g: (g.output("y", g.input("x", (0, 8))), g.build()), GraphError,
     r"build: node %1 \(output\) has shape \(0, 8\), size 0 on axis 0"),
    (lambda g: (g.output("y", g.einsum("ab->ab", g.input("x", ("B", 8)))), g.build().bind(B=0)),
     GraphError, r"bind: node %1 \(einsum\) has shape \(0, 8\), size 0 on axis 0 \(B=0\): a "
                 "result needs every size at least 1"),
    (lambda g: (g.output("y", g.einsum("ab->a", g.input("x", (2, "P")), join=lambda v: v,
                                       agg="max")), g.build().bind(P=0)),
     GraphError, r"node %1 \(einsum\) aggregates \(max\) over index 'b' of size 0 \(P=0\)"),
])
def test_api_errors_are_typed(build, error, message):
    with pytest.raises(error, match=message):
        build(GraphBuilder())


def test_an_empty_input_is_allowed():
    """A cache of no rows yet (P=0) is an input a concat extends: bound, it is no error."""
    g = GraphBuilder()
    x, cache = g.input("x", (2, 4)), g.input("cache", ("P", 4), role="cache")
    g.output("keys", g.einsum("td->td", g.concat([cache, x], axis=0)))
    assert g.build().bind(P=0).nodes[2].shape == (2, 4)


def test_api_defaults_that_stay():
    """The product join contracts by summing (as np.einsum), a join of one's own with agg
    given, and NumPy arithmetic that builds a SymPy expression, are all accepted."""
    g = GraphBuilder()
    x, w = _x(g), g.input("w", (8, 3), "f32", role="weight")
    assert g.einsum("ab,bc->ac", x, w).node.op.agg == "sum"
    assert g.einsum("ab->a", x, join=lambda v: v * v, agg="max").node.op.agg == "max"
    assert g.einsum("ab->ab", x, join=lambda v: np.add(v, 1)).node.op.join == scalar.x(0) + 1


# ------------------------------------------------------------------ random weights


def test_random_array_makes_any_box_as_the_whole_has_it():
    a = RandomArray((5, 7, 9), key=12345, loc=0.5, scale=2.0)
    whole = np.asarray(a)
    assert whole.dtype == np.float32 and whole.shape == (5, 7, 9)
    for box in [(slice(1, 3), slice(2, 6)), (2,), (slice(None), 3), (..., 4), (1, 2, 3),
                (slice(0, 5, 2), slice(1, 7, 3)), (slice(4, 2),), ...]:
        np.testing.assert_array_equal(a[box], whole[box])
    assert abs(whole.mean() - 0.5) < 0.2 and abs(whole.std() - 2.0) < 0.2


def test_random_weights_are_made_per_block_never_whole():
    """A block of a tensor far larger than memory (4 PB of float32) is made directly."""
    huge = RandomArray((1 << 25, 1 << 25), key=7, loc=0.0, scale=1.0)
    block = huge[(1 << 24): (1 << 24) + 3, 5:9]
    assert block.shape == (3, 4) and np.isfinite(block).all()
    np.testing.assert_array_equal(block[1:, 2:], huge[(1 << 24) + 1: (1 << 24) + 3, 7:9])


def test_random_weights_depend_on_seed_and_name_only():
    from einpage.models import preset
    cfg = preset("tiny")
    a, b, c = RandomWeights(cfg, 3), RandomWeights(cfg, 3), RandomWeights(cfg, 4)
    for name in ("embed", "layers.0.wq", "norm"):
        np.testing.assert_array_equal(np.asarray(a(name)), np.asarray(b(name)))
        assert not np.array_equal(np.asarray(a(name)), np.asarray(c(name)))
    assert not np.array_equal(np.asarray(a("layers.0.wq")), np.asarray(a("layers.1.wq")))
    norm = np.asarray(a("norm"))
    assert abs(norm.mean() - 1.0) < 0.1  # gains near 1


# ------------------------------------------------------------------ plans and checkpoints


@pytest.fixture
def plan(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    path = tmp_path / "plan.json"
    assert cli("compile", ckpt, "--gpu-mem", "20KB", "--seq", "3", "-o", path, "--quiet") == 0
    capsys.readouterr()
    return path, ckpt


def test_plan_runs_with_its_checkpoint(plan, capsys):
    path, ckpt = plan
    assert cli("run", path, "--checkpoint", ckpt, "--tokens", "1,2,3") == 0
    from_plan = capsys.readouterr().out
    assert cli("run", ckpt, "--tokens", "1,2,3") == 0
    assert capsys.readouterr().out == from_plan


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden=48, heads=4, kv_heads=2), "tensor 'model.embed_tokens.weight' has shape "
                                           "(64, 48), but the plan reads it as (64, 32)"),
    (dict(intermediate=40), "tensor 'model.layers.0.mlp.gate_proj.weight' has shape (40, 32), "
                            "but the plan reads it as (48, 32)"),
    (dict(dtype="f16"), "tensor 'model.embed_tokens.weight' is f16, but the plan was compiled "
                        "from a checkpoint of f32"),
])
def test_plan_refuses_a_checkpoint_it_was_not_made_for(plan, tmp_path, capsys, kwargs, message):
    path, _ = plan
    other = write_checkpoint(tmp_path / "other", **kwargs)
    code = cli("run", path, "--checkpoint", other, "--tokens", "1,2,3")
    assert_one_line_error(capsys, code, message)


def test_plan_weights_names_the_first_tensor_that_differs(plan, tmp_path):
    from einpage.ir.memgraph import MemGraph
    from einpage.models.checkpoint import Checkpoint
    from einpage.runners import plan_weights
    path, ckpt = plan
    mg = MemGraph.load(path)
    weights = plan_weights(mg, Checkpoint(ckpt))
    assert weights("norm").shape == (32,)
    with pytest.raises(CheckpointError, match="has shape"):
        plan_weights(mg, Checkpoint(write_checkpoint(tmp_path / "o", vocab=96)))


# ------------------------------------------------------------------ the command line itself


def _commands():
    """(name, parser) for einpage itself and each of its commands."""
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [("einpage", parser), *subs.choices.items()], subs


def test_every_option_has_help_and_lists_its_choices():
    """Every option and positional of every command has help text; an option with a fixed set
    shows it (`--phase {prefill,decode}`) and refuses anything else; every command has a line
    in `einpage --help`."""
    commands, subs = _commands()
    missing, unlisted = [], []
    for command, parser in commands:
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = f"{command} {'/'.join(action.option_strings) or action.dest}"
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(name)
            if action.choices and "{" + ",".join(map(str, action.choices)) + "}" not in text:
                unlisted.append(name)
    assert not missing, f"options without help: {missing}"
    assert not unlisted, f"options whose choices the help does not show: {unlisted}"
    assert all(a.help for a in subs._choices_actions)
    assert {a.dest for a in subs._choices_actions} == set(subs.choices)


def test_policy_help_names_every_policy():
    from einpage.compiler import POLICIES
    from einpage.cli.common import POLICY_HELP
    assert all(name in POLICY_HELP for name in POLICIES)


def test_version(capsys):
    assert cli("--version") == 0
    assert capsys.readouterr().out == f"einpage {__version__}\n"
