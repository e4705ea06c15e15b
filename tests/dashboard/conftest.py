"""Fixtures: a directory of real traces (with the rank traces of a real TP=2 engine run), the app
served in-process, headless Chromium."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tracekit.browser import CHROMIUM, CHROMIUM_ARGS
from tracekit.engine_loop import TraceRecipe, write_engine_trace

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts" / "dashboard"
UPLOAD_CAP_MB = 0.25
BIG_STEPS = 3000


@dataclass(frozen=True)
class TraceSet:
    root: Path
    sync: Path
    async_: Path
    other_model: Path
    big: Path
    outside: Path  # a file outside root, reachable only through the escaping symlink
    ranks: tuple[Path, ...]  # tp.rank0.pftrace, tp.rank1.pftrace: a rank set
    broken_ranks: tuple[Path, ...]  # broken.rank0 (a real rank trace), broken.rank1 (garbage)


# A short run: 8 requests at once, a handful of steady decode steps on both ranks.
TP_WORKLOAD = "synthetic:n=8,in=8-16,out=8-16,rate=1000,seed=0"


@pytest.fixture(scope="session")
def tp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The rank traces of ``stepscope run --tensor-parallel-size 2`` on the CPU (2 gloo ranks,
    one process each): about 7 s, once per session."""
    out = tmp_path_factory.mktemp("tp_run")
    cmd = [
        sys.executable, "-m", "stepscope", "run",
        "--model", str(REPO / "samples/models/pycoder-14m"), "--workload", TP_WORKLOAD,
        "--tensor-parallel-size", "2", "--device", "cpu", "--no-progress",
        "--trace", str(out / "tp.pftrace"),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return out / "tp.rank0.pftrace", out / "tp.rank1.pftrace"


@pytest.fixture(scope="session")
def traces(tmp_path_factory: pytest.TempPathFactory, tp_run: tuple[Path, Path]) -> TraceSet:
    base = tmp_path_factory.mktemp("dashboard")
    root = base / "traces"
    (root / "nested").mkdir(parents=True)
    outside = base / "secret.pftrace"
    outside.write_bytes(b"not for the browser")
    os.symlink(outside, root / "escape.pftrace")
    ranks = tuple(Path(shutil.copy(p, root / p.name)) for p in tp_run)
    broken = (
        Path(shutil.copy(tp_run[0], root / "broken.rank0.pftrace")),
        root / "broken.rank1.pftrace",
    )
    broken[1].write_bytes(b"this is not a trace at all\n" * 40)
    return TraceSet(
        root=root,
        sync=write_engine_trace(root / "sync.pftrace", TraceRecipe(num_steps=40)),
        async_=write_engine_trace(
            root / "async.pftrace", TraceRecipe(num_steps=40, async_scheduling=True)
        ),
        other_model=write_engine_trace(
            root / "nested" / "other_model.pftrace",
            TraceRecipe(num_steps=40, async_scheduling=True, model="other-llama"),
        ),
        big=write_engine_trace(
            root / "big.pftrace", TraceRecipe(num_steps=BIG_STEPS, async_scheduling=True)
        ),
        outside=outside,
        ranks=ranks,
        broken_ranks=broken,
    )


class Server:
    """The dashboard's WSGI app on an OS-chosen port, in a thread of this process."""

    def __init__(self, wsgi_app: object) -> None:
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no access log per request
        self._server = make_server("127.0.0.1", 0, wsgi_app, threaded=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="test-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)


PERFETTO_STUB = """<!doctype html><title>perfetto stub</title><body>stub</body><script>
window.pings = 0; window.received = null;
window.addEventListener('message', function (e) {
  if (e.data === 'PING') {
    window.pings += 1;
    if (window.pings >= 3) e.source.postMessage('PONG', e.origin);  // answer only after a few
    return;
  }
  if (e.data && e.data.perfetto) {
    var bytes = new Uint8Array(e.data.perfetto.buffer), s = '';
    for (var i = 0; i < bytes.length; i += 8192) s += String.fromCharCode.apply(null, bytes.subarray(i, i + 8192));
    window.received = {b64: btoa(s), title: e.data.perfetto.title, fileName: e.data.perfetto.fileName,
                       origin: e.origin, pings: window.pings};
  }
});
</script>"""


@pytest.fixture(scope="session")
def perfetto_stub() -> Iterator[Server]:
    """A page on another origin that speaks the Perfetto UI's side of the handshake."""

    def app(environ: dict, start_response: object) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])  # type: ignore[operator]
        return [PERFETTO_STUB.encode()]

    server = Server(app)
    yield server
    server.close()


@pytest.fixture(scope="session")
def dashboard(traces: TraceSet, perfetto_stub: Server) -> Iterator[Server]:
    from dashboard.app import create_app
    from dashboard.config import DashboardConfig

    config = DashboardConfig(
        traces_dir=traces.root,
        port=0,
        max_upload_mb=UPLOAD_CAP_MB,
        perfetto_url=perfetto_stub.url + "/",
    )
    server = Server(create_app(config).server)
    yield server
    server.close()


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (scripts/setup.sh does)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@dataclass
class _Tab:
    page: object
    errors: list[str]


@pytest.fixture(scope="session")
def _tab(browser: object) -> Iterator[_Tab]:
    """One browser tab for every browser test: opening a tab costs about 5 s on 2 cores (a new
    renderer), loading the app into an open one about 1 s. Each test gets it freshly navigated
    to the app (a new document: no state of the previous test survives, ``dcc.Store`` keeps it
    in memory)."""
    context = browser.new_context(viewport={"width": 1500, "height": 1000})  # type: ignore[attr-defined]
    context.set_default_timeout(60_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield _Tab(page, errors)
    context.close()


@pytest.fixture
def page(_tab: _Tab, dashboard: Server) -> Iterator[object]:
    page: Any = _tab.page
    _tab.errors.clear()
    page.goto(dashboard.url + "/")
    page.wait_for_selector("#trace-picker")
    yield page
    errors = list(_tab.errors)
    page.goto("about:blank")  # stop what the test left running
    for other in page.context.pages:  # popups the test opened
        if other is not page:
            other.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def screenshot(page: object, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)  # type: ignore[attr-defined]
    return path
