"""The trace writer in a child process: Perfetto encoding off the engine's GIL.

Encoding a raw event into protobuf costs several microseconds of Python; on the tracer's flush
thread it holds the GIL the engine thread needs, and when the engine is host-bound every one of
those microseconds (and the GIL hand-over delays around them) is lost throughput. With
:class:`ProcessWriter` the flush thread only pickles each flat batch of raw events (the tracer's
buffer as it is, ``instrument.events``; one C call, about a microsecond per event) and writes it to a pipe; a child process (``python -m
instrument.writer_process``) owns the :class:`~instrument.perfetto_writer.PerfettoWriter` (capture
gate, ring, interning) and does the rest. The file and its metadata are the same as with the
in-process writer, byte for byte in content.

Protocol on the child's stdin: frames of a 4-byte little-endian length and a pickled tuple
``(op, *args)``: ``("part", items)`` (the first items of a flat batch, buffered by the child;
a part may end inside an event), ``("write", items, thread_names)`` (the batch's last items: the
child writes the parts and these as one batch), ``("sync",)`` (the child answers one byte on stdout once everything before
it is written: :meth:`ProcessWriter.sync`), ``("finish", dropped, ts_ns, skipped_steps,
skipped_instants)`` (``PerfettoWriter.finish``). The child ignores
SIGINT/SIGTERM (the parent's handlers close the trace) and on end of input without ``finish``
(the parent was killed) writes the whole events of the parts it holds and closes what it has: a
loadable prefix.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from itertools import islice
from typing import IO, Any

from instrument.capture import CaptureConfig
from instrument.events import RawEvent, flatten

__all__ = ["ProcessWriter", "main"]

_LEN = struct.Struct("<I")
# Events pickled in one call. ``pickle.dumps`` holds the GIL for its whole call: a 0.5 s batch at
# batch 256 (~7,000 events) took 6.9 ms on the dev CPU, longer than the host's lead over the
# device in a host-bound step; a part of 512 took 0.36 ms. Between parts the pipe write releases
# the GIL (docs/design.md §4.9, "Trace writer"). In flat items: ~512 events of ~6 fields.
PICKLE_CHUNK = 3072


def _plain(value: Any) -> Any:
    """An arg value that failed to pickle, as the writer would encode it: int / float / bool /
    str / None kept (and their subclasses), anything else as its ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _sanitize(items: list[Any]) -> list[Any]:
    """A flat batch whose every field pickles (dict args: plain keys and values)."""
    out: list[Any] = []
    for f in items:
        if isinstance(f, dict):
            out.append({str(k): _plain(v) for k, v in f.items()})
        elif isinstance(f, tuple):  # a counter sample's names or values
            out.append(tuple(_plain(v) for v in f))
        else:
            out.append(_plain(f))
    return out


class ProcessWriter:
    """The tracer-facing side: same ``write`` / ``finish`` calls as ``PerfettoWriter``."""

    def __init__(self, path: str, capture: CaptureConfig | None = None) -> None:
        capture = capture or CaptureConfig()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        config = pickle.dumps(
            tuple(getattr(capture, f) for f in CaptureConfig.__dataclass_fields__)
        ).hex()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "instrument.writer_process", path, config, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[bytes] = self._proc.stdin
        self._stdout: IO[bytes] = self._proc.stdout
        self._lock = threading.Lock()
        self._closed = False
        self.sync()  # the child is up and has opened the file

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 -- an arg that does not pickle: its str, as encoded
            op, events, *rest = message
            data = pickle.dumps((op, _sanitize(events), *rest), protocol=pickle.HIGHEST_PROTOCOL)
        self._stdin.write(_LEN.pack(len(data)) + data)

    def write(self, events: list[RawEvent], thread_names: dict[int, tuple[str, int]]) -> None:
        """:meth:`write_flat` of event tuples."""
        self.write_flat(flatten(events), thread_names)

    def write_flat(self, events: list[Any], thread_names: dict[int, tuple[str, int]]) -> None:
        """Hand one flat batch to the child, pickled in parts of at most :data:`PICKLE_CHUNK`
        items (each part's pipe write releases the GIL); the child writes it as one batch."""
        self.write_taken(iter(events), len(events), thread_names)

    def write_taken(
        self, items: Iterator[Any], n: int, thread_names: dict[int, tuple[str, int]]
    ) -> None:
        """:meth:`write_flat` of the next ``n`` items of ``items``, taken a part at a time: the
        tracer's flush thread passes its buffer's ``popleft`` iterator, so it holds the GIL for
        one part's pop and pickle at most, never for the whole batch's pop (a 0.5 s batch at
        batch 256, ~41,000 items, is ~0.7 ms of popping in one C call on the dev CPU)."""
        with self._lock:
            if self._closed:
                return
            while n > PICKLE_CHUNK:
                self._send(("part", list(islice(items, PICKLE_CHUNK))))
                self._stdin.flush()
                n -= PICKLE_CHUNK
            self._send(("write", list(islice(items, n)), thread_names))
            self._stdin.flush()

    def sync(self) -> None:
        """Return once the child has written everything sent so far."""
        with self._lock:
            if self._closed:
                return
            self._send(("sync",))
            self._stdin.flush()
            if self._stdout.read(1) != b"k":
                raise RuntimeError(f"trace writer process exited ({self._proc.wait()})")

    def finish(
        self,
        dropped: dict[str, int],
        ts_ns: int,
        skipped_steps: dict[str, int] | None = None,
        skipped_instants: int = 0,
    ) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._send(("finish", dropped, ts_ns, skipped_steps, skipped_instants))
            self._stdin.close()
        code = self._proc.wait(timeout=120)
        if code != 0:
            raise RuntimeError(f"trace writer process failed with exit code {code}")


def _read_exact(stream: IO[bytes], n: int) -> bytes | None:
    data = stream.read(n)
    return data if data is not None and len(data) == n else None


def main(argv: list[str]) -> int:
    """Child: ``python -m instrument.writer_process PATH CONFIG_HEX PID``."""
    from instrument.perfetto_writer import PerfettoWriter

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    path, config_hex, pid = argv
    capture = CaptureConfig(*pickle.loads(bytes.fromhex(config_hex)))
    writer = PerfettoWriter(path, capture=capture, pid=int(pid))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    parts: list[Any] = []  # the flat items of the batch being received
    names: dict[int, tuple[str, int]] = {}
    while True:
        head = _read_exact(stdin, _LEN.size)
        body = None if head is None else _read_exact(stdin, _LEN.unpack(head)[0])
        if body is None:  # the parent died: keep what was written, and the parts received
            if parts:  # whole events only: the last part may end inside one
                writer.write_flat(parts, names)
            writer.close()
            return 0
        op, *args = pickle.loads(body)
        if op == "part":
            parts.extend(args[0])
        elif op == "write":
            events, sent_names = args
            names = {int(k): tuple(v) for k, v in sent_names.items()}
            if parts:
                events, parts = parts + events, []
            writer.write_flat(events, names)
        elif op == "sync":
            stdout.write(b"k")
            stdout.flush()
        elif op == "finish":
            writer.finish(*args)
            return 0
        else:  # pragma: no cover
            raise ValueError(f"unknown writer op {op!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
