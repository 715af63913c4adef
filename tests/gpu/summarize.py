"""Write the GPU check's one summary file: passed or failed, why, and the numbers.

Reads what tests/gpu/device_check.sh left: call 1's ``call1.json`` (in the
stage directory), pytest's JUnit file, the benchmark's JSON and the steps'
times (``steps.tsv``, in the output directory), and writes ``summary.json``
there, printing it too::

    python tests/gpu/summarize.py --out DIR --stage DIR [--pytest-rc N] [--why TEXT]
                                  [--running pytest|bench]

The status is "passed" only when the gpu tests ran (none skipped, none
failed), else "failed". Call 2 writes it three times: before pytest
(``--running pytest``: should the device's limit cut the call there, this
one stays and says so), after pytest (``--running bench``) and at the end;
``complete`` is true only in the last.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any


def junit_counts(path: Path) -> dict[str, Any] | None:
    """Counts and the names of failed or skipped tests in a JUnit file."""
    if not path.exists():
        return None
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError as exc:
        return {"error": f"unreadable junit file: {exc}"}
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: list[str] = []
    skipped: list[str] = []
    for case in root.iter("testcase"):
        counts["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts["failures"] += 1
            failed.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            skipped.append(name)
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed, "skipped_tests": skipped}


def ran_clean(counts: dict[str, Any] | None) -> bool:
    return bool(
        counts
        and "error" not in counts
        and counts["tests"] > 0
        and counts["failures"] == counts["errors"] == counts["skipped"] == 0
    )


def steps(path: Path) -> list[dict[str, Any]] | None:
    """The steps device_check.sh timed: name, cap, seconds, exit status."""
    if not path.exists():
        return None
    rows = [line.split("\t") for line in path.read_text().splitlines() if line.count("\t") == 3]
    return [{"step": n, "cap": int(c), "seconds": int(t), "rc": rc} for n, c, t, rc in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stage", type=Path, required=True)
    parser.add_argument("--pytest-rc", type=int, default=None)
    parser.add_argument("--why", default=None, help="why the check stopped early")
    parser.add_argument(
        "--running", choices=("pytest", "bench"), default=None, help="the step about to start"
    )
    args = parser.parse_args(argv)

    call1_path = args.stage / "call1.json"
    call1 = json.loads(call1_path.read_text()) if call1_path.exists() else None
    tests = junit_counts(args.out / "junit.xml")
    bench_path = args.out / "bench.json"
    bench = json.loads(bench_path.read_text()) if bench_path.exists() else None

    if args.why:
        status, why = "failed", args.why
    elif args.running == "pytest":
        status, why = (
            "failed",
            "call 2 stopped during pytest: this summary was written before it "
            "(the device's time ran out?)",
        )
    elif ran_clean(tests) and args.pytest_rc in (None, 0):
        status, why = "passed", "every gpu test ran and passed"
    elif tests and tests.get("tests") and not tests.get("failures") and tests.get("skipped"):
        status, why = "failed", "gpu tests were skipped"
    elif tests is None:
        status, why = "failed", f"pytest left no results (exit status {args.pytest_rc})"
    else:
        status, why = "failed", f"pytest exited {args.pytest_rc}"
    summary: dict[str, Any] = {
        "status": status,
        "why": why,
        "complete": args.running is None,
        "call1": call1,
        "pytest": tests,
        "steps": steps(args.out / "steps.tsv"),
    }
    if bench is not None:
        summary["bench"] = {
            key: bench.get(key)
            for key in (
                "raw_single_stream_tok_s",
                "trioserve_single_stream_tok_s",
                "ratio",
                "ratios",
                "trioserve_aggregate_tok_s",
                "batching",
                "max_batch",
                "cuda_graphs",
                "note",
            )
        }
    elif args.running == "bench":
        summary["bench"] = "running: the call stopped before the benchmark finished"
    elif not args.why and args.running is None:
        summary["bench"] = "no results (bench.txt says why)"
    text = json.dumps(summary, indent=2)
    (args.out / "summary.json").write_text(text + "\n")
    print(text)
    return 0 if status == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
