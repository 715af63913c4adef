"""Write the GPU check's one summary file: passed or failed, why, and the numbers.

Reads what tests/gpu/device_check.sh left: call 1's ``call1.json`` (in the
stage directory), pytest's JUnit files and the benchmark's JSON (in the output
directory), and writes ``summary.json`` there, printing it too::

    python tests/gpu/summarize.py --out DIR --stage DIR [--pytest-rc N] [--why TEXT]

The status is "passed" only when the gpu tests ran (none skipped, none failed)
with ExLlamaV2's defaults; "passed without CUDA graphs" when only the rerun
with ``EXLLAMA_NO_GRAPHS=1`` passed; "failed" otherwise.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stage", type=Path, required=True)
    parser.add_argument("--pytest-rc", type=int, default=None)
    parser.add_argument("--why", default=None, help="why the check stopped early")
    args = parser.parse_args(argv)

    call1_path = args.stage / "call1.json"
    call1 = json.loads(call1_path.read_text()) if call1_path.exists() else None
    tests = junit_counts(args.out / "junit.xml")
    no_graphs = junit_counts(args.out / "junit-nographs.xml")
    bench_path = args.out / "bench.json"
    bench = json.loads(bench_path.read_text()) if bench_path.exists() else None

    if args.why:
        status, why = "failed", args.why
    elif ran_clean(tests) and args.pytest_rc in (None, 0):
        status, why = "passed", "every gpu test ran and passed"
    elif ran_clean(no_graphs):
        status, why = "passed without CUDA graphs", "the tests pass only with EXLLAMA_NO_GRAPHS=1"
    elif tests and tests.get("tests") and not tests.get("failures") and tests.get("skipped"):
        status, why = "failed", "gpu tests were skipped"
    else:
        status, why = "failed", f"pytest exited {args.pytest_rc}"
    summary: dict[str, Any] = {
        "status": status,
        "why": why,
        "call1": call1,
        "pytest": tests,
        "pytest_no_graphs": no_graphs,
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
    text = json.dumps(summary, indent=2)
    (args.out / "summary.json").write_text(text + "\n")
    print(text)
    return 0 if status.startswith("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
