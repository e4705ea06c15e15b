"""How long until a 100k-step trace is on screen in the dashboard?

Writes a simulated async engine run with the real Tracer (tracekit/engine_loop.py),
serves the dashboard in-process, drives headless Chromium through Playwright and times:

* ``analyse``: server-side load + §4 metrics (cold, first pick of the trace);
* ``overview``: pick in the browser -> verdict cards and blame chart drawn (includes ``analyse``);
* ``timeline``: switch to the timeline tab -> the zoomed-out (density) figure drawn;
* ``zoom``: drag-zoom to ~0.2% of the trace -> single slices drawn;
* ``per_step``: switch to the per-step tab -> the five panels drawn.

Usage::

    python bench/bench_dashboard.py [--steps 100000] [--out out/bench_dashboard.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard.app import create_app  # noqa: E402
from dashboard.config import DashboardConfig  # noqa: E402
from dashboard.store import TraceRef, TraceStore  # noqa: E402
from tracekit.browser import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from tracekit.engine_loop import TraceRecipe, write_engine_trace  # noqa: E402

TIMEOUT_MS = 300_000


def _serve(traces_dir: Path) -> tuple[object, str, TraceStore]:
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    app = create_app(DashboardConfig(traces_dir=traces_dir, port=0))
    server = make_server("127.0.0.1", 0, app.server, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return (
        server,
        f"http://127.0.0.1:{server.server_port}/",
        app.server.extensions["stepscope_store"],
    )


def _plotted(page: object, graph: str) -> None:
    page.wait_for_function(  # type: ignore[attr-defined]
        f"() => {{ const g = document.querySelector('{graph} .js-plotly-plot');"
        " return g && g.data && g.data.length && g.querySelector('.main-svg'); }",
        timeout=TIMEOUT_MS,
    )


def _timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    elapsed = time.perf_counter() - start
    print(f"  {fn.__name__}: {elapsed:.2f} s", file=sys.stderr)  # type: ignore[attr-defined]
    return elapsed


def run_browser(url: str, name: str) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    out: dict[str, float] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(url)
        page.wait_for_selector("#trace-picker")

        def overview() -> None:
            page.click("#trace-picker")
            page.get_by_role("option", name=name, exact=True).click()
            page.wait_for_selector("#overview .card")
            _plotted(page, "#overview")

        out["overview_s"] = _timed(overview)

        def timeline() -> None:
            page.locator(".tab", has_text="Timeline").click()
            page.wait_for_selector("#timeline-info:has-text('density')")
            _plotted(page, "#timeline")

        out["timeline_s"] = _timed(timeline)

        def zoom() -> None:
            # Two drags of 2% each (plotly ignores drags under a few pixels): 0.04% of the trace.
            for _ in range(2):
                before = page.inner_text("#timeline-info")
                box = page.locator("#timeline .nsewdrag").first.bounding_box()
                y = box["y"] + box["height"] / 2
                page.mouse.move(box["x"] + box["width"] * 0.50, y)
                page.mouse.down()
                page.mouse.move(box["x"] + box["width"] * 0.52, y, steps=4)
                page.mouse.up()
                page.wait_for_function(
                    "b => document.querySelector('#timeline-info').innerText !== b",
                    arg=before,
                    timeout=TIMEOUT_MS,
                )
            page.wait_for_selector("#timeline-info:has-text('detail')")
            _plotted(page, "#timeline")

        out["zoom_s"] = _timed(zoom)

        def per_step() -> None:
            page.locator(".tab", has_text="Per step").click()
            _plotted(page, "#steps-graph")

        out["per_step_s"] = _timed(per_step)
        browser.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--out", type=Path, default=Path("out/bench_dashboard.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        traces = Path(tmp)
        name = f"engine_{args.steps}.pftrace"
        t0 = time.perf_counter()
        path = write_engine_trace(
            traces / name, TraceRecipe(num_steps=args.steps, async_scheduling=True)
        )
        write_s = time.perf_counter() - t0
        server, url, store = _serve(traces)
        try:
            browser = run_browser(url, name)
        finally:
            server.shutdown()  # type: ignore[attr-defined]
        loaded = store.load(TraceRef("traces", name))  # cached: load_s is the browser's cold load
        result = {
            "steps": args.steps,
            "slices": len(loaded.report.frames.slices),
            "trace_mb": path.stat().st_size / 1e6,
            "write_s": write_s,
            "analyse_s": loaded.load_s,
            **browser,
        }
    rows = [
        (
            "trace",
            f"{result['steps']:,} steps, {result['slices']:,} slices, {result['trace_mb']:.1f} MB",
        ),
        ("write (Tracer)", f"{result['write_s']:.2f} s"),
        ("analyse (load + metrics), cold", f"{result['analyse_s']:.2f} s"),
        ("first render: pick -> overview drawn", f"{result['overview_s']:.2f} s"),
        ("timeline tab (density) drawn", f"{result['timeline_s']:.2f} s"),
        ("drag-zoom -> single slices drawn", f"{result['zoom_s']:.2f} s"),
        ("per-step tab drawn", f"{result['per_step_s']:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
