"""Upload temp folders are removed (close, garbage collection, SIGTERM of the server), and a trace
the analysis refuses (e.g. over the loader's decompressed-size limit) becomes a clear banner."""

from __future__ import annotations

import gc
import gzip
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from analysis import TraceError
from dashboard.callbacks import _error_text
from dashboard.store import TraceStore

REPO = Path(__file__).resolve().parents[2]


def test_close_and_collection_remove_the_uploads_folder(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, max_cached=1, max_upload_bytes=1000)
    ref = store.save_upload("a.pftrace", b"abc")
    root = store.upload_root
    assert store.resolve(ref).read_bytes() == b"abc"
    store.close()
    assert not root.exists()
    store.close()  # idempotent
    other = TraceStore(tmp_path, max_cached=1, max_upload_bytes=1000)
    other_root = other.upload_root
    other.save_upload("b.pftrace", b"xyz")
    del other
    gc.collect()
    assert not other_root.exists()


def test_refused_upload_is_a_banner_naming_the_upload(tmp_path: Path) -> None:
    store = TraceStore(tmp_path, max_cached=1, max_upload_bytes=10_000)
    ref = store.save_upload("bomb.json.gz", gzip.compress(b"\x01garbage" * 100))
    with pytest.raises(TraceError) as info:
        store.load(ref)
    text = _error_text(info.value)
    assert ref.name in text and str(store.upload_root) not in text  # no server paths
    store.close()
    # The loader's size limit raises TraceError: its words reach the banner as they are.
    limit = TraceError("x.json.gz: decompresses past the limit of 1.0 GB")
    assert _error_text(limit) == str(limit)
    assert "more memory" in _error_text(MemoryError())
    assert "nested too deeply" in _error_text(RecursionError())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_sigterm_removes_the_uploads_folder(tmp_path: Path) -> None:
    """The served dashboard, stopped by SIGTERM, leaves no ``stepscope-uploads-*`` behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)}
    cmd = [sys.executable, "-m", "stepscope.cli", "dashboard", "--traces", str(tmp_path)]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
        assert [p.name.startswith("stepscope-uploads-") for p in tmp.iterdir()] == [True]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list(tmp.iterdir()) == []
