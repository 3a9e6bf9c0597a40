"""`einpage compile` / `inspect` / `devices` predictions on the command line: the report keys, device
choice and overrides, pictures, the progress bar, and one-line errors for bad device input."""
from __future__ import annotations

import io
import json

import pytest

from einpage.cli import main
from einpage.cli.progress import Progress

PREDICTION_KEYS = ("makespan_s", "compute_s", "h2d_s", "d2h_s", "stall_s", "lower_bound_s",
                   "efficiency", "tokens_per_s", "device")


def _main(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys, *argv):
    code, out, err = _main(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_compile_json_has_the_prediction(capsys):
    r = _json(capsys, "compile", "llama-7b", "--gpu-mem", "16GB")
    for key in PREDICTION_KEYS:
        assert key in r, key
    assert r["device"] == "h100-pcie"
    assert 0 < r["lower_bound_s"] <= r["makespan_s"]
    assert 0 < r["efficiency"] <= 1
    assert r["tokens_per_s"] == pytest.approx(2048 / r["makespan_s"])
    assert r["h2d_bytes"] == r["reload_bytes"]


def test_slower_link_and_device_change_the_prediction(capsys):
    case = ("compile", "llama3.2-1b", "--gpu-mem", "1GB", "--seq", "256")  # 2.47 GB of weights
    fast = _json(capsys, *case)
    slow = _json(capsys, *case, "--h2d-bandwidth", "5GB/s")
    assert slow["h2d_s"] > 5 * fast["h2d_s"] and slow["makespan_s"] > fast["makespan_s"]
    v100 = _json(capsys, *case, "--device", "v100")
    assert v100["device"] == "v100" and v100["compute_s"] > fast["compute_s"]
    flops = _json(capsys, *case, "--flops", "10T")
    assert flops["compute_s"] > 10 * fast["compute_s"]


def test_a_model_that_fits_moves_nothing(capsys):
    r = _json(capsys, "compile", "small", "--gpu-mem", "1GB", "--seq", "16")
    assert r["h2d_bytes"] == r["d2h_bytes"] == 0 and r["stall_s"] == 0
    assert r["efficiency"] == pytest.approx(1.0)


def test_lookahead_forms(capsys):
    for value, shown in (("auto", "auto: "), ("1ms", "1 ms of compute"), ("2GB", "2.00 GB")):
        r = _json(capsys, "compile", "llama-7b", "--gpu-mem", "16GB", "--seq", "512",
                  "--lookahead", value)
        assert shown in r["lookahead"]


def test_text_report_and_inspect(capsys, tmp_path):
    plan = tmp_path / "p.json"
    code, out, err = _main(capsys, "compile", "llama-7b", "--gpu-mem", "16GB", "-o", plan)
    assert code == 0, err
    assert "predicted on h100-pcie" in out and "efficiency" in out
    saved = _json(capsys, "inspect", plan)
    assert saved["device"] == "h100-pcie" and saved["model"] == "llama-7b"
    assert saved["tokens"] == 2048 and saved["tokens_per_s"] > 0
    a100 = _json(capsys, "inspect", plan, "--device", "a100-pcie")
    assert a100["device"] == "a100-pcie" and a100["makespan_s"] > saved["makespan_s"]
    code, out, err = _main(capsys, "inspect", plan)
    assert code == 0 and "valid" in out and "predicted on h100-pcie" in out


def test_devices_lists_profiles_and_writes_files_that_load(capsys, tmp_path):
    code, out, _ = _main(capsys, "devices")
    assert code == 0 and "h100-pcie" in out and "rtx4090" in out
    profiles = _json(capsys, "devices")
    f = tmp_path / "t4.json"
    f.write_text(json.dumps(profiles["t4"]))
    r = _json(capsys, "compile", "llama-7b", "--gpu-mem", "8GB", "--seq", "512",
              "--device-file", f)
    assert r["device"] == "t4"
    f.write_text(json.dumps(dict(profiles["t4"], name="my-card")))
    plan = tmp_path / "p.json"
    code, _, err = _main(capsys, "compile", "tiny", "--gpu-mem", "8KB", "--seq", "4",
                         "--device-file", f, "-o", plan)
    assert code == 0, err
    assert _json(capsys, "inspect", plan)["device"] == "h100-pcie"  # not registered: default


def test_plot_and_dot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png, plan, dot = tmp_path / "t.png", tmp_path / "p.json", tmp_path / "g.dot"
    code, _, err = _main(capsys, "compile", "tiny", "--gpu-mem", "8KB", "--seq", "4", "-o", plan,
                         "--plot", png)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png.unlink()
    code, _, err = _main(capsys, "inspect", plan, "--plot", png, "--dot", dot)
    assert code == 0, err
    assert png.stat().st_size > 1000 and dot.read_text().startswith("digraph")


@pytest.mark.parametrize("extra, needle", [
    (["--device", "h100"], "unknown device"),
    (["--device-file", "/nonexistent/p.json"], "no such device profile"),
    (["--h2d-bandwidth", "fast"], "bad --h2d-bandwidth"),
    (["--h2d-bandwidth=-1GB/s"], "bad --h2d-bandwidth"),
    (["--flops", "0"], "bad --flops"),
    (["--lookahead", "soon"], "bad --lookahead"),
    (["--lookahead", "0ms"], "bad --lookahead"),
    (["--device", "t4", "--device-file", "x.json"], "x.json: no such device profile"),
])
def test_bad_device_input_exits_2_with_one_line(capsys, extra, needle):
    code, out, err = _main(capsys, "compile", "tiny", "--gpu-mem", "1MB", "--seq", "4", *extra)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err, err


def test_bad_profile_file_exits_2(capsys, tmp_path):
    f = tmp_path / "p.json"
    for text in ("{", '{"matmul_flops": 1e12, "hbm_bandwidth": 0, "h2d_bandwidth": 1e9}'):
        f.write_text(text)
        code, _, err = _main(capsys, "compile", "tiny", "--gpu-mem", "1MB", "--device-file", f)
        assert code == 2 and len(err.strip().splitlines()) == 1, err


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal_after_a_delay():
    quiet = io.StringIO()
    p = Progress(stream=quiet, delay=0.0)
    p("lowering", 5, 10)
    assert quiet.getvalue() == ""  # not a terminal
    tty = _Tty()
    p = Progress(stream=tty, delay=0.0)
    p("lowering", 5, 10)
    assert "lowering" in tty.getvalue() and "50%" in tty.getvalue()
    p.close()
    assert tty.getvalue().endswith("\r")
    late = _Tty()
    p = Progress(stream=late, delay=3600)
    p("lowering", 5, 10)
    assert late.getvalue() == ""
    off = _Tty()
    Progress(enabled=False, stream=off, delay=0)("lowering", 1, 2)
    assert off.getvalue() == ""


def test_a_served_load_is_a_generation_per_count_of_concurrent_requests(capsys):
    from einpage.compiler import CompileOptions
    from einpage.forecast import forecast_generation
    from einpage.models import resolve
    from einpage.predict.devices import get_device
    r = _json(capsys, "compile", "tiny", "--gpu-mem", "1MB", "--seq", 16, "--max-new-tokens", 8,
              "--concurrent", "1,4")
    assert [x["concurrent"] for x in r["loads"]] == [1, 4]
    cfg, _ = resolve("tiny")
    for load in r["loads"]:
        f = forecast_generation(cfg, load["concurrent"], 16, 8,
                                CompileOptions(1_000_000, device=get_device("h100-pcie")))
        assert load["tokens_per_s"] == pytest.approx(f.tokens_per_s)
        assert load["per_request_tokens_per_s"] == pytest.approx(f.tokens_per_s / f.batch)
        assert load["first_token_s"] == pytest.approx(f.prefill_s)
    assert r["loads"][1]["tokens_per_s"] > r["loads"][0]["tokens_per_s"]
    code, _, err = _main(capsys, "compile", "tiny", "--gpu-mem", "1MB", "--concurrent", "2")
    assert code == 2 and "add --max-new-tokens" in err
    code, _, err = _main(capsys, "compile", "tiny", "--gpu-mem", "1MB", "--max-new-tokens", 2,
                         "--concurrent", "0,2")
    assert code == 2 and "every count at least 1" in err
