"""UCX's log, kept by the worker: the protocol selections it reports (ucx_proto_info.py) and its warnings.

`UcxLog.enable()` runs before the process's first NIXL agent: UCX reads its logging settings once, when NIXL's
UCX backend loads it. It has UCX report its READ selections (UCX_PROTO_INFO=*get*: one table per endpoint
configuration, when UCX first chooses) into a file in a private directory (UCX_LOG_FILE) instead of the
worker's stdout, then, once the agent exists (UCX opened the file), `open()` keeps a descriptor and removes the
file and its directory: nothing is left behind whichever way the process ends. Every UCX log line then passes
through `poll()`: tables become Selections, the rest (UCX's warnings and errors) goes on to the worker's log
(`pdserve.ucx`), so redirecting the file hides nothing. UCX buffers the file, so `poll()` first calls
`ucs_log_flush()` of the libucs already loaded in the process; that flush also fsyncs, so the file lives on tmpfs
(/dev/shm) where there is one, and the worker's periodic poll runs in a thread.

Settings made by whoever runs the worker win: with UCX_LOG_FILE set UCX writes there and nothing is observed,
with UCX_PROTO_INFO set to anything but a glob that covers READs (`y`, `*get*`) there is nothing to read. The
variables are put back after the agent is made, so processes the worker starts later do not inherit them.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
import shutil
import tempfile
import threading

from pdserve.kv_transfer.ucx_proto_info import Selection, TableParser, is_table_line, message

log = logging.getLogger("pdserve.ucx")

PROTO_GLOB = "*get*"  # READs only: a handful of tables per process, none per transfer
_LEVEL = re.compile(r"\bUCX\s+([A-Z]+)\b")  # "select.c:722  UCX  ERROR   no active messages transport ..."
_LIBUCS = re.compile(r"^libucs([-.][^/]*)?\.so")  # libucs.so.0, a wheel's libucs-14c218c5.so.0.0.0; not libucs_signal
_LEVELS = {"FATAL": logging.ERROR, "ERROR": logging.ERROR, "WARN": logging.WARNING, "DIAG": logging.INFO,
           "INFO": logging.INFO}


def _libucs() -> str | None:
    """Path of the libucs this process has loaded (None: UCX not loaded yet)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if _LIBUCS.match(os.path.basename(path)):
                    return path
    except OSError:
        pass
    return None


def _tmpfs() -> str | None:
    """/dev/shm where it is usable: UCX's flush fsyncs its file, ~2 ms on this host's ext4 against 0.5 us on
    tmpfs. None: the default temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK) else None


class UcxLog:
    def __init__(self):
        self._dir: str | None = None
        self._path = ""
        self._set: dict[str, str | None] = {}  # variables this set, with what they held before
        self._fd: int | None = None
        self._flush = None
        self._lock = threading.Lock()
        self._parser = TableParser()
        self._tail = b""
        self.selections: list[Selection] = []  # in the order UCX reported them
        self.reason = "not enabled"  # why nothing is observed, while `active` is False

    @property
    def active(self) -> bool:
        return self._fd is not None

    def enable(self) -> None:
        """Before the first NIXL agent of this process."""
        if _libucs() is not None:
            self.reason = "UCX was loaded before its log could be set up"
            return
        if os.environ.get("UCX_LOG_FILE"):
            self.reason = "UCX_LOG_FILE is set: UCX logs there"
            return
        self._dir = tempfile.mkdtemp(prefix="pdserve-ucx-", dir=_tmpfs())
        self._path = os.path.join(self._dir, f"ucx.{os.getpid()}.log")
        want = {"UCX_LOG_FILE": self._path}
        if "UCX_PROTO_INFO" not in os.environ:
            want["UCX_PROTO_INFO"] = PROTO_GLOB
        for k, v in want.items():
            self._set[k] = os.environ.get(k)
            os.environ[k] = v

    def open(self) -> None:
        """After the first NIXL agent: keep the file UCX opened, remove its name, restore the environment."""
        for k, old in self._set.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old
        self._set = {}
        if self._dir is None:
            return
        try:
            lib = _libucs()
            if lib is None:  # without its flush the tables would arrive whenever UCX's buffer fills
                self.reason = "libucs is not loaded in this process"
                return
            self._flush = ctypes.CDLL(lib, mode=os.RTLD_NOLOAD).ucs_log_flush
            self._fd = os.open(self._path, os.O_RDONLY)
            self.reason = ""
        except (OSError, AttributeError) as e:
            self.reason = f"UCX's log file could not be read: {e}"
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def poll(self) -> None:
        """Read what UCX logged since the last poll: tables -> self.selections, other lines -> the log."""
        if self._fd is None:
            return
        with self._lock:
            if self._flush is not None:
                self._flush()
            chunks = []
            while chunk := os.read(self._fd, 1 << 16):
                chunks.append(chunk)
            if not chunks:
                return
            data = self._tail + b"".join(chunks)
            *lines, self._tail = data.split(b"\n")
            for raw in lines:
                self._line(raw.decode(errors="replace"))

    def _line(self, line: str) -> None:
        msg = message(line)
        got = self._parser.feed(msg)
        if got is not None:
            self.selections.append(got)
        elif msg and not is_table_line(msg):
            level = _LEVEL.search(msg)
            # lines without a level (a backtrace's) follow an error: shown like one
            log.log(_LEVELS.get(level.group(1), logging.DEBUG) if level else logging.WARNING, "UCX: %s", msg)

    def mark(self) -> int:
        """A position in the report: `since(mark)` is what UCX reported after it."""
        self.poll()
        with self._lock:
            return len(self.selections)

    def since(self, mark: int) -> list[Selection]:
        self.poll()
        with self._lock:
            return self.selections[mark:]

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
