"""Where a decode step's time goes, loop by loop: a sampled profile of libpnmix_core under Linux perf.

    python tools/loop_profile.py [BUILD_DIR[:ISA[:ARITH]]] [--context 32768] [--threads 2] [--seconds 5]
                                 [--queries 1] [--heads 32/8/128] [--functions 3] [--loops 6]

A child process makes tools/core_ab.py's call (decode_case: batch 1, the default config, fp16 tokens
and queries) again and again for --seconds under `perf record -e cpu-clock`, the kernel's clock,
which samples where the machine has no hardware counters (this project's virtual machines have
none). Recording starts after the child has filled its cache. BUILD_DIR (a folder holding
libpnmix_core.so; default: the library pnmix loads), ISA and ARITH pick the kernel as in
core_ab.py (`::int8`: the default library's integer path). Prints
  * the functions with the most samples, and
  * for each of the top --functions of libpnmix_core, its hottest innermost loops (a backward jump
    closes a loop; those holding another are left out), each with its share of the function's
    samples, its instructions and its copies of one 512-bit register into another.
Those copies are what to look for in a loop bound by the vector ports: a 512-bit copy is not
eliminated at rename and takes a port like real work, and GCC 12 leaves them where an
expression's result could overwrite an input (docs/BENCHMARKS.md section 2.19: the softmax's
exponential). A sample lands on the instruction after a slow one, so read the shares of loops,
not of single instructions.
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

from core_ab import folder_problem, heads_arg, parse_build  # (tools/ is the script's folder, first on sys.path)

TOOLS = Path(__file__).resolve().parent
CORE = "libpnmix_core"
PERCENT_FIELD = re.compile(r"^([0-9.]+)%$")
SYMBOL_FIELD = re.compile(r"^\[.\]\s+(.+)$")
ANNOTATE_LINE = re.compile(r"^\s+([0-9.]+)\s+:\s+([0-9a-f]+):\s+(.*)$")
BACKWARD_JUMP = re.compile(r"\bj[a-z]+\s+([0-9a-f]+)\s+<")
ZMM_COPY = re.compile(r"^vmov(aps|ups|apd|upd|dqa32|dqa64|dqu8|dqu16|dqu32|dqu64)\s+%zmm\d+,%zmm\d+$")

# The child: the call of tools/core_ab.py, again and again until the time is up. It tells perf to
# start (`enable` on the control FIFO) once the cache is filled and the call warmed up, so that
# neither is in the profile; a bad ISA or arithmetic is one line on stderr and exit status 1.
CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from core_ab import decode_case
from pnmix.backends.core_ops import CoreOps
from pnmix.errors import PnMixError
control, seconds, isa, arith = sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5]
context, threads, queries, q_heads, kv_heads, dim = (int(x) for x in sys.argv[6:12])
try:
    ops = CoreOps(threads)
    ops.set_isa(isa)
    ops.set_arith(arith)
except PnMixError as exc:
    sys.exit(f"error: {exc}")
q, layout, state, k_new, v_new = decode_case(context, queries, q_heads, kv_heads, dim)
ops.attend(q, layout, state, context, k_new, v_new)
with open(control, "w") as fifo:
    fifo.write("enable\\n")
calls, end = 0, time.time() + seconds
while time.time() < end:
    ops.attend(q, layout, state, context, k_new, v_new)
    calls += 1
print(f"{calls} calls, kernel {ops.isa()}, arithmetic {ops.arith_for(layout)}", flush=True)
"""


@dataclass
class Loop:
    header: int  # the backward jump's target
    back_edge: int  # the address of the (farthest) backward jump to it
    share: float  # percent of the function's samples
    instructions: int
    zmm_copies: int


def parse_report(text: str) -> list[tuple[float, str, str]]:
    """(percent, object, symbol) of each line of `perf report --sort dso,symbol -t TAB`, in its
    order (tab-separated: a C++ symbol holds spaces and commas)."""
    entries = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split("\t")]
        if len(fields) < 3 or not (percent := PERCENT_FIELD.match(fields[0])):
            continue
        symbol = SYMBOL_FIELD.match(fields[2])
        entries.append((float(percent[1]), fields[1], symbol[1] if symbol else fields[2]))
    return entries


def parse_annotate(text: str) -> list[tuple[int, float, str]]:
    """(address, percent, instruction) of each instruction line of `perf annotate --stdio`."""
    rows = [(int(m[2], 16), float(m[1]), m[3].strip()) for m in map(ANNOTATE_LINE.match, text.splitlines()) if m]
    return sorted(rows)


def loops(rows: list[tuple[int, float, str]], max_span: int = 4096) -> list[Loop]:
    """The loops of one function's instructions, hottest first: a backward jump to an address of the
    function at most max_span bytes back closes one. A header with several backward jumps (a
    `continue`) is one loop, up to the farthest."""
    addresses = {address for address, _, _ in rows}
    back_edges: dict[int, int] = {}
    for address, _, instruction in rows:
        jump = BACKWARD_JUMP.search(instruction)
        if jump and (header := int(jump[1], 16)) in addresses and 0 < address - header <= max_span:
            back_edges[header] = max(address, back_edges.get(header, address))
    found = []
    for header, back_edge in back_edges.items():
        body = [(percent, text) for address, percent, text in rows if header <= address <= back_edge]
        found.append(Loop(header, back_edge, sum(p for p, _ in body), len(body),
                          sum(1 for _, text in body if ZMM_COPY.match(text))))
    return sorted(found, key=lambda loop: -loop.share)


def innermost(found: list[Loop]) -> list[Loop]:
    """The loops that hold no other loop (an outer loop's share repeats its inner ones')."""
    return [loop for loop in found
            if not any(other is not loop and loop.header <= other.header and other.back_edge <= loop.back_edge
                       for other in found)]


def capture(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def last_line(done: subprocess.CompletedProcess) -> str:
    return (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["(no message)"])[-1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", nargs="?", default="", help="a folder holding libpnmix_core.so, optionally :ISA[:ARITH]")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--queries", type=int, default=1, help="> 1: a chunk of that many queries and new K/V")
    parser.add_argument("--heads", default="32/8/128", help="query heads / KV heads / head dim")
    parser.add_argument("--functions", type=int, default=3, help="functions of libpnmix_core to break into loops")
    parser.add_argument("--loops", type=int, default=6, help="loops listed per function")
    args = parser.parse_args()
    args.q_heads, args.kv_heads, args.dim = heads_arg(parser, args.heads)
    if min(args.context, args.threads, args.queries, args.functions, args.loops) < 1 or not 0 < args.seconds <= 600:
        parser.error("--context, --threads, --queries, --functions and --loops must be positive and --seconds in (0, 600]")
    args.folder, args.isa, args.arith = parse_build(args.build)
    if args.folder and (problem := folder_problem(args.folder)):
        parser.error(problem)
    args.perf = shutil.which("perf")
    if args.perf is None:
        parser.error("Linux perf is not installed (the linux-perf package, or your distribution's perf)")
    return args


def record(args: argparse.Namespace, data: Path) -> subprocess.CompletedProcess:
    """perf record over the child, from the moment it enables recording; -N: no copy of every
    sampled library into ~/.debug."""
    control = data.with_suffix(".ctl")
    os.mkfifo(control)
    env = dict(os.environ)
    if args.folder:
        env["PNMIX_LIB_DIR"] = str(Path(args.folder).resolve())
    child = [sys.executable, "-c", CHILD, str(TOOLS), str(control), str(args.seconds), args.isa, args.arith,
             *(str(x) for x in (args.context, args.threads, args.queries, args.q_heads, args.kv_heads, args.dim))]
    return capture([args.perf, "record", "-q", "-N", "-e", "cpu-clock", "-F", "5000", "-D", "-1",
                    f"--control=fifo:{control}", "-o", str(data), "--", *child], env=env)


def print_loops(perf: str, data: Path, dso: str, symbol: str, percent: float, limit: int) -> None:
    annotated = capture([perf, "annotate", "-i", str(data), "--stdio", "--dsos", dso, "-s", symbol])
    print(f"\n{symbol}: {percent:.2f}% of the samples")
    if annotated.returncode:
        print(f"  (perf annotate failed: {last_line(annotated)})")
        return
    rows = parse_annotate(annotated.stdout)
    if not rows:
        print("  (perf annotate printed no instructions for it)")
        return
    found = innermost(loops(rows))
    if not found:
        print("  (no loop: no backward jump in it)")
    for loop in found[:limit]:
        print(f"  {loop.share:5.1f}% of it  {loop.header:x}-{loop.back_edge:x}  {loop.instructions} instructions, "
              f"{loop.zmm_copies} 512-bit register copies")


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        recorded = record(args, data)
        if recorded.returncode:
            print(f"error: the profiled call failed: {last_line(recorded)}", file=sys.stderr)
            return 1
        print(recorded.stdout.strip())
        report = capture([args.perf, "report", "-i", str(data), "--stdio", "--no-children", "--sort", "dso,symbol",
                          "--percent-limit", "0.5", "-t", "\t"])
        if report.returncode:
            print(f"error: perf report failed: {last_line(report)}", file=sys.stderr)
            return 1
        entries = parse_report(report.stdout)
        print(f"{'share':>7}  function")
        for percent, dso, symbol in entries[:12]:
            print(f"{percent:>6.2f}%  {symbol}  ({dso})")
        print("\ninnermost loops of the top functions of libpnmix_core (share of the function's samples):")
        core = [e for e in entries if e[1].startswith(CORE)][:args.functions]
        if not core:
            print("  (no function of libpnmix_core took 0.5% of the samples)")
        for percent, dso, symbol in core:
            print_loops(args.perf, data, dso, symbol, percent, args.loops)
    return 0


if __name__ == "__main__":
    sys.exit(main())
