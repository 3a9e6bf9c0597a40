"""Compile time against an earlier commit, side by side (issue: the planner within 5% of the bound;
"no row's compile time up by more than 1.5x"). Compile seconds move with the load of a shared
machine by 2x from one day to the next (llama-13b prefill at 12 GB compiled in 0.14 s at the
commit before the issue on the day its grid was taken, 0.29 s at the same commit on a later day),
so a ratio against a figure recorded on another day says little. This runs each case of
`bench/planner_grid.py` as `einpage compile <flags> --json` at both commits in turn (base, then
the working tree, alternating, `--repeats` rounds), and reports the compiler's own
`compile_seconds` of each (the median of the rounds) and their ratio.

    python bench/compile_ratio.py --base 2f898f6               # every case, one round
    python bench/compile_ratio.py --base 2f898f6 --repeats 3 --only "llama-13b"
    python bench/compile_ratio.py --base 2f898f6 --json rows.json
    python bench/compile_ratio.py --base HEAD --flags="--policy lru"   # a flag, side by side

The base commit is checked out into a temporary git worktree and run from there (its own CLI, its
own options); the case list is this tree's. A case the base cannot run (a model or flag it did not
have) is listed with its error.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_grid import CASES, ROOT  # noqa: E402

#: The ratio the issue allows
LIMIT = 1.5


def compile_seconds(tree: Path, argv: list[str]) -> tuple[float | None, str | None]:
    """`einpage compile ... --json` run from `tree`: its compile seconds, or (None, the error)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = "import sys; from einpage.cli.main import main; sys.exit(main())"
    run = subprocess.run([sys.executable, "-c", code, *argv, "--json"], cwd=tree, env=env,
                         capture_output=True, text=True)
    if run.returncode != 0:
        lines = (run.stderr or run.stdout).strip().splitlines()
        return None, lines[-1] if lines else f"exit status {run.returncode}"
    report = json.loads(run.stdout.strip().splitlines()[-1])
    return float(report["compile_seconds"]), None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare against")
    ap.add_argument("--repeats", type=int, default=1, help="rounds per case (median taken)")
    ap.add_argument("--only", help="only the cases whose flags contain this text")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--base-flags", default="",
                    help='more flags for the base\'s runs (--base-flags="--policy lru")')
    ap.add_argument("--flags", default="",
                    help='more flags for this tree\'s runs (--flags="--policy lru")')
    args = ap.parse_args(argv)
    cases = [c for c in CASES if args.only is None or args.only in c.flags]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base],
                       cwd=ROOT, check=True, capture_output=True)
        try:
            for k, case in enumerate(cases, 1):
                times: dict[str, list[float]] = {"base": [], "now": []}
                error = None
                for _ in range(args.repeats):
                    for name, tree, more in (("base", base, args.base_flags),
                                             ("now", ROOT, args.flags)):
                        s, err = compile_seconds(tree, [*case.argv, *shlex.split(more)])
                        if s is None:
                            error = error or f"{name}: {err}"
                        else:
                            times[name].append(s)
                row = {"flags": case.flags, "error": error,
                       **{name: statistics.median(v) if v else None for name, v in times.items()}}
                if row["base"] and row["now"]:
                    row["ratio"] = row["now"] / row["base"]
                rows.append(row)
                shown = f"{row['ratio']:.2f}x" if "ratio" in row else error
                print(f"[{k}/{len(cases)}] {case.flags}: {shown}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT,
                           capture_output=True)
    done = sorted((r for r in rows if "ratio" in r), key=lambda r: r["ratio"])
    base_text = " ".join([args.base, *shlex.split(args.base_flags)])
    now_text = " ".join(["this tree", *shlex.split(args.flags)])
    print(f"compile seconds: base {base_text} against {now_text}, side by side, median of "
          f"{args.repeats} round(s)\n")
    print("| case | base s | now s | ratio |")
    print("|---|---|---|---|")
    for r in done:
        print(f"| {r['flags']} | {r['base']:.2f} | {r['now']:.2f} | {r['ratio']:.2f} |")
    if done:
        ratios = [r["ratio"] for r in done]
        print(f"\n{len(done)} cases: median ratio {statistics.median(ratios):.2f}, "
              f"{sum(x > LIMIT for x in ratios)} above {LIMIT}x; sum "
              f"{sum(r['base'] for r in done):.1f} s -> {sum(r['now'] for r in done):.1f} s")
    for r in rows:
        if "ratio" not in r:
            print(f"- not compared: {r['flags']}: {r['error']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
