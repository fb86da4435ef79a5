"""The corpus table: every real-model corpus model x every check, with errors and times.

    python bench/corpus_report.py [--models a,b] [--checks fuse,inplace] [--out FILE.md]

Each model runs in its own process (a fresh kernel cache and RNG, and a crash stays in its
row); fused kernels run in Triton's interpreter (TRITON_INTERPRET=1) as in the tests.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _one_model(name: str, checks: list[str]) -> None:
    """Child process: run the checks on one model and print each Result as a JSON line."""
    from corpus.checks import run

    for check in checks:
        r = run(name, check)
        print(json.dumps({"check": check, "status": r.status, "error": r.error, "detail": r.detail,
                          "seconds": r.seconds}), flush=True)


def main(argv=None) -> int:
    from corpus import CORPUS
    from corpus.checks import CHECKS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CORPUS))
    parser.add_argument("--checks", default=",".join(CHECKS))
    parser.add_argument("--out", help="also write the table (markdown) and the details here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    checks = args.checks.split(",")
    if args.child:
        _one_model(args.child, checks)
        return 0
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    header = "| model | library | " + " | ".join(checks) + " | seconds |"
    lines = [header, "|" + "---|" * (len(checks) + 3)]
    details, failures = [], 0
    print(header, flush=True)
    for name in args.models.split(","):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", name, "--checks", ",".join(checks)],
                              capture_output=True, text=True, env=env)
        rows = {}
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                rows[r["check"]] = r
        cells = []
        for check in checks:
            r = rows.get(check)
            if r is None:
                cells.append("crashed")
                details.append(f"- {name} {check}: the process ended: {proc.stderr.strip().splitlines()[-1:]}")
                failures += 1
                continue
            figure = "" if r["error"] is None else f" {r['error']:.1e}"
            cells.append(f"{r['status']}{figure}")
            failures += r["status"] in ("fail", "error")
            if r["detail"]:
                details.append(f"- {name} {check} ({r['seconds']:.1f} s): {r['status']}: {r['detail']}")
        line = f"| {name} | {CORPUS[name].library} | " + " | ".join(cells) + f" | {time.perf_counter() - start:.0f} |"
        lines.append(line)
        print(line, flush=True)
    print("\n" + "\n".join(details))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n\n" + "\n".join(details) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
