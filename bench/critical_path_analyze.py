"""Critical-path CPU of `stepscope analyze --json` against `json.load`'s CPU (issue 14).

On a loaded machine wall times say little about the two-core design (docs/design.md §6): this
measures, in CPU seconds, each segment of the CLI's parent (up to the decode fork, the imports
until it joins the decode child, frames and report up to the blame fork, the parent's share
beside the blame child, the tail) and each forked child's CPU (``RUSAGE_CHILDREN`` around its
join), then the critical path: prefork + max(imports, decode child) + frames/report +
max(parent share, blame child) + tail + exit. Its ratio to `json.load`'s CPU, measured in the
same round, estimates the wall ratio on a machine where each process has a core of its own.

    PYTHONPATH=CHECKOUT python bench/critical_path_analyze.py TRACE ROUNDS
"""

import json
import os
import resource
import statistics
import subprocess
import sys

if len(sys.argv) != 3 or not sys.argv[2].isdigit():
    sys.exit(f"usage: PYTHONPATH=CHECKOUT python {sys.argv[0]} TRACE ROUNDS\n\n{__doc__}")
F = sys.argv[1]
N = int(sys.argv[2])
CHILD = r"""
import sys, time, resource, json
marks = []
def cpu(): return time.process_time()
def kids():
    r = resource.getrusage(resource.RUSAGE_CHILDREN); return r.ru_utime + r.ru_stime
import analysis.forked as Fk
orig_start = Fk.start; orig_result = Fk.Forked.result
def start(*a, **k):
    marks.append(("fork", cpu(), kids())); return orig_start(*a, **k)
def result(self):
    marks.append(("join", cpu(), kids())); r = orig_result(self); marks.append(("joined", cpu(), kids())); return r
Fk.start = start; Fk.Forked.result = result
import analysis.cli as C
oj = C._print_json
def pj(x): oj(x); marks.append(("json", cpu(), kids()))
C._print_json = pj
from stepscope.cli import main
sys.argv = ["stepscope", "analyze", sys.argv[1], "--json"]
import atexit
atexit.register(lambda: print(json.dumps(marks), file=sys.stderr))
main()
"""
JL = "import json,gzip,sys; json.load(gzip.open(sys.argv[1]))"
rows = []
for _ in range(N):
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", JL, F], check=True)
    a = resource.getrusage(resource.RUSAGE_CHILDREN)
    jl = a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime
    b = a
    p = subprocess.run(
        [sys.executable, "-c", CHILD, F],
        cwd=os.environ["PYTHONPATH"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    a = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime
    m = json.loads(p.stderr.strip().splitlines()[-1])
    d = {k: [] for k in ("fork", "join", "joined", "json")}
    for k, c, kc in m:
        d[k].append((c, kc))
    f1, f2 = d["fork"][0], d["fork"][1] if len(d["fork"]) > 1 else None
    j1, j1e = d["join"][0], d["joined"][0]
    dec_child = j1e[1] - j1[1]  # CPU of the decode child (reaped at the first join)
    prefork = f1[0]
    imports = j1[0] - f1[0]
    if f2:
        j2, j2e = d["join"][1], d["joined"][1]
        frames_report_pre = f2[0] - j1e[0]
        parent_par = j2[0] - f2[0]
        blame_child = j2e[1] - j2[1]
        tail = d["json"][0][0] - j2e[0]
    else:
        frames_report_pre = d["json"][0][0] - j1e[0]
        parent_par = blame_child = tail = 0
    parent_cpu = d["json"][0][0]
    exit_cpu = total - parent_cpu - dec_child - blame_child
    crit = (
        prefork
        + max(imports, dec_child)
        + frames_report_pre
        + max(parent_par, blame_child)
        + tail
        + exit_cpu
    )
    rows.append((jl, total, crit))
    print(
        f"json.load {jl:.2f}  cli cpu {total:.2f}  prefork {prefork:.2f} imports {imports:.2f} | decode child {dec_child:.2f}  frames+report-pre {frames_report_pre:.2f}  parent-par {parent_par:.2f} | blame child {blame_child:.2f}  tail {tail:.2f} exit+other {exit_cpu:.2f}  critical {crit:.2f}  ratio {crit / jl:.2f}  load {os.getloadavg()[0]:.1f}"
    )
print(
    "median critical/json.load",
    round(statistics.median(c / j for j, t, c in rows), 2),
    "median cpu ratio",
    round(statistics.median(t / j for j, t, c in rows), 2),
)
