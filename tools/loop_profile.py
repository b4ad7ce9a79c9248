"""Where a decode step's time goes, loop by loop: a sampled profile of libpnmix_core under Linux perf.

    python tools/loop_profile.py [BUILD_DIR[:ISA[:ARITH]]] [--context 32768] [--threads 2] [--seconds 5]
                                 [--heads 32/8/128] [--functions 3] [--loops 6]

A child process repeats one decode call (batch 1, the default config, one query; the cache of
tools/core_ab.py) for --seconds under `perf record -e cpu-clock`: the kernel's clock, which samples
where the machine has no hardware counters (this project's virtual machines have none). BUILD_DIR
(a folder holding libpnmix_core.so; default: the library pnmix loads) and ISA / ARITH (core_ab.py's
form) pick the kernel. Prints
  * the functions with the most samples, and
  * for each of the top --functions of libpnmix_core, its hottest innermost loops (a backward jump
    closes a loop; those holding another are left out), each with its share of the function's
    samples, its instructions and its copies of one 512-bit register into another.
Those copies are what to look for: a 512-bit copy is not eliminated at rename and takes a vector
port like real work, and GCC 12 leaves them where an expression's result could overwrite an input
(the softmax exponential had four in its 24 instructions: 1.5-3% of a 32K step). A sample lands on
the instruction after a slow one, so read the shares of loops, not of single instructions.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
CORE = "libpnmix_core"
REPORT_FIELDS = re.compile(r"^\s*([0-9.]+)%$")
SYMBOL_FIELD = re.compile(r"^\[.\]\s+(.+)$")
ANNOTATE_LINE = re.compile(r"^\s+([0-9.]+)\s+:\s+([0-9a-f]+):\s+(.*)$")
BACKWARD_JUMP = re.compile(r"\bj[a-z]+\s+([0-9a-f]+)\s+<")
ZMM_COPY = re.compile(r"^vmov(aps|ups|apd|upd|dqa32|dqa64|dqu32|dqu64)\s+%zmm\d+,%zmm\d+$")

# The child: the call of tools/core_ab.py, repeated until the time is up.
CHILD = """
import sys, time, torch
from pnmix.backends.core_ops import CoreOps
from pnmix.bench.decode import fill_cache
from pnmix.config import PnMixConfig
from pnmix.format import CacheLayout
context, threads, seconds, q_heads, kv_heads, dim, isa, arith = sys.argv[1:9]
context, threads, q_heads, kv_heads, dim = int(context), int(threads), int(q_heads), int(kv_heads), int(dim)
ops = CoreOps(threads)
if isa != "auto":
    ops.set_isa(isa)
if arith != "auto":
    ops.set_arith(arith)
layout = CacheLayout(PnMixConfig(), 1, kv_heads, dim, context)
generator = torch.Generator().manual_seed(0)
k = torch.randn(1, kv_heads, context, dim, generator=generator)
v = torch.randn(1, kv_heads, context, dim, generator=generator)
state = fill_cache(layout, k, v, threads)
q = torch.randn(1, q_heads, 1, dim, generator=generator)
calls, end = 0, time.time() + float(seconds)
while time.time() < end:
    ops.attend(q, layout, state, context, None, None)
    calls += 1
print(f"{calls} calls, kernel {ops.isa()}", flush=True)
"""


@dataclass
class Loop:
    first: int  # address of the jump's target
    last: int  # address of the backward jump
    share: float  # percent of the function's samples
    instructions: int
    zmm_copies: int


def parse_report(text: str) -> list[tuple[float, str, str]]:
    """(percent, object, symbol) of each line of `perf report --sort dso,symbol -t TAB`, in its
    order (tab-separated: a C++ symbol holds spaces and commas)."""
    entries = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split("\t")]
        if len(fields) < 3 or not (percent := REPORT_FIELDS.match(fields[0])):
            continue
        symbol = SYMBOL_FIELD.match(fields[2])
        entries.append((float(percent[1]), fields[1], symbol[1] if symbol else fields[2]))
    return entries


def parse_annotate(text: str) -> list[tuple[int, float, str]]:
    """(address, percent, instruction) of each instruction line of `perf annotate --stdio`."""
    rows = [(int(m[2], 16), float(m[1]), m[3].strip()) for m in map(ANNOTATE_LINE.match, text.splitlines()) if m]
    return sorted(rows)


def loops(rows: list[tuple[int, float, str]], max_span: int = 4096) -> list[Loop]:
    """The loops of one function's instructions, hottest first: each backward jump to an address of
    the function at most max_span bytes back closes one, from its target to the jump."""
    addresses = {address for address, _, _ in rows}
    found = []
    for address, _, instruction in rows:
        jump = BACKWARD_JUMP.search(instruction)
        if not jump:
            continue
        target = int(jump[1], 16)
        if target >= address or address - target > max_span or target not in addresses:
            continue
        body = [(p, text) for a, p, text in rows if target <= a <= address]
        found.append(Loop(target, address, sum(p for p, _ in body), len(body),
                          sum(1 for _, text in body if ZMM_COPY.match(text))))
    return sorted(found, key=lambda loop: -loop.share)


def innermost(found: list[Loop]) -> list[Loop]:
    """The loops that hold no other loop (an outer loop's share repeats its inner ones')."""
    return [loop for loop in found
            if not any(other is not loop and loop.first <= other.first and other.last <= loop.last
                       and (other.first, other.last) != (loop.first, loop.last) for other in found)]


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def last_line(done: subprocess.CompletedProcess) -> str:
    return (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["(no message)"])[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", nargs="?", help="a folder holding libpnmix_core.so, optionally :ISA[:ARITH]")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--heads", default="32/8/128", help="query heads / KV heads / head dim")
    parser.add_argument("--functions", type=int, default=3, help="functions of libpnmix_core to break into loops")
    parser.add_argument("--loops", type=int, default=6, help="loops listed per function")
    args = parser.parse_args()
    try:
        q_heads, kv_heads, dim = (int(x) for x in args.heads.split("/"))
    except ValueError:
        parser.error(f"--heads {args.heads!r}: give QUERY/KV/DIM, e.g. 9/3/64")
    if args.context < 1 or args.threads < 1 or not 0 < args.seconds <= 600:
        parser.error("--context and --threads must be positive and --seconds in (0, 600]")
    perf = shutil.which("perf")
    if perf is None:
        parser.error("Linux perf is not installed (apt install linux-perf, or your distribution's perf package)")
    folder, isa, arith = ((args.build or "") + "::").split(":")[:3]
    env = dict(os.environ)
    if folder:
        sys.path.insert(0, str(TOOLS))
        from core_ab import folder_problem

        if problem := folder_problem(folder):
            parser.error(problem)
        env["PNMIX_LIB_DIR"] = str(Path(folder).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "perf.data")
        child = [sys.executable, "-c", CHILD, str(args.context), str(args.threads), str(args.seconds),
                 str(q_heads), str(kv_heads), str(dim), isa or "auto", arith or "auto"]
        recorded = run([perf, "record", "-e", "cpu-clock", "-F", "5000", "-o", data, "--", *child], env=env)
        if recorded.returncode:
            print(f"error: perf record failed: {last_line(recorded)}", file=sys.stderr)
            return 1
        print(recorded.stdout.strip().splitlines()[-1] if recorded.stdout.strip() else "")
        report = run([perf, "report", "-i", data, "--stdio", "--no-children", "--sort", "dso,symbol",
                      "--percent-limit", "0.5", "-t", "\t"])
        if report.returncode:
            print(f"error: perf report failed: {last_line(report)}", file=sys.stderr)
            return 1
        entries = parse_report(report.stdout)
        print(f"{'share':>7}  function")
        for percent, dso, symbol in entries[:12]:
            print(f"{percent:>6.2f}%  {symbol}  ({dso})")
        for percent, dso, symbol in [e for e in entries if e[1].startswith(CORE)][:args.functions]:
            annotated = run([perf, "annotate", "-i", data, "--stdio", "--dsos", dso, "-s", symbol])
            found = innermost(loops(parse_annotate(annotated.stdout)))
            print(f"\n{symbol}: {percent:.2f}% of the samples; its innermost loops (share of the function's samples):")
            if not found:
                print("  (no loop found: perf annotate printed no instructions for it)")
            for loop in found[:args.loops]:
                print(f"  {loop.share:5.1f}%  {loop.first:x}-{loop.last:x}  {loop.instructions} instructions, "
                      f"{loop.zmm_copies} 512-bit register copies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
