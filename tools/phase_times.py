"""Where a packed group's time goes: the phases of a profiling build of libpnmix_core.

    cmake -S plugins -B build/phases -DPNMIX_PHASE_TIMES=ON && cmake --build build/phases --target pnmix_core
    python tools/phase_times.py build/phases[:ISA[:ARITH]] [--context 32768] [--threads 1] [--blocks 10]
                                [--heads 32/8/128]

Runs tools/core_ab.py with that one build (the same cache and calls: batch 1, by default 32 query / 8 KV
heads, head dim 128, one query) in a child process. At exit the library prints how many time-stamp ticks each
phase of attend_group took in all (plugins/src/phase_times.h names the phases); this tool turns them
into ticks and nanoseconds per group and KV head and shares of the total. The timers cost a
counter read per phase, a few percent of a group; the outputs are bitwise those of a normal build.
Only attend_group is timed (decode and few-query calls), not a work item's setup or the merge.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from core_ab import folder_problem, parse_build  # (tools/ is the script's folder, first on sys.path)

TOOLS = Path(__file__).resolve().parent
HEADER = re.compile(r"^pnmix phase times: (\d+) groups, ([0-9.]+) ticks per ns$")
PHASE = re.compile(r"^pnmix phase (\w+) (\d+)$")


def parse(stderr: str) -> tuple[int, float, dict[str, int]] | None:
    """(groups, ticks per ns, {phase: ticks}) from the library's exit lines, or None without them."""
    groups, rate, phases = 0, 0.0, {}
    for line in stderr.splitlines():
        if match := HEADER.match(line):
            groups, rate = int(match[1]), float(match[2])
        elif match := PHASE.match(line):
            phases[match[1]] = int(match[2])
    return (groups, rate, phases) if groups and phases else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", help="a PNMIX_PHASE_TIMES build's folder, optionally :ISA[:ARITH] (core_ab.py's form)")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=10, help="rounds of five calls")
    parser.add_argument("--heads", default="32/8/128", help="QUERY/KV/DIM (core_ab.py's; 9/3/64: SmolLM2-135M's)")
    args = parser.parse_args()
    folder = parse_build(args.build)[0]
    if problem := folder_problem(folder):  # before the child: one line, not its traceback
        parser.error(problem)
    command = [sys.executable, str(TOOLS / "core_ab.py"), args.build, "--context", str(args.context),
               "--threads", str(args.threads), "--blocks", str(args.blocks), "--heads", args.heads]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        last = (run.stderr.strip().splitlines() or ["(no message)"])[-1]
        print(f"error: tools/core_ab.py failed: {last}", file=sys.stderr)
        return 1
    parsed = parse(run.stderr)
    if parsed is None:
        print(f"error: {folder}: no phase times printed: not a PNMIX_PHASE_TIMES build "
              "(cmake -S plugins -B DIR -DPNMIX_PHASE_TIMES=ON)", file=sys.stderr)
        return 1
    groups, rate, phases = parsed
    print(run.stdout.strip().splitlines()[-1])
    total = sum(phases.values())
    print(f"{groups} groups timed (warm-up included), {rate:.3f} ticks per ns")
    print(f"{'phase':<12} {'ticks/group':>12} {'ns/group':>9} {'share':>7}")
    for name, ticks in phases.items():
        print(f"{name:<12} {ticks / groups:>12.0f} {ticks / groups / rate:>9.1f} {100 * ticks / total:>6.1f}%")
    print(f"{'all':<12} {total / groups:>12.0f} {total / groups / rate:>9.1f} {100.0:>6.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
