"""One process's log relay: `python -m epd_serve.runtime.log_relay LOG MAX_BYTES FILES`.

Started by a Child (child.py) beside each process it starts, reading that process's
output (stdout and stderr, one pipe) on its standard input and writing it into the log
file, rolled over by size (supervision.ChildLog). It is a process of its own, in a
session of its own, so that what happens to the supervisor costs the children nothing:
a supervisor stopped or killed leaves every child writing its log as before. Nor does a
slow disk block a child: one thread reads the pipe into a bounded queue at once,
another writes the file; when the file falls that far behind, lines are dropped (and
the log says how many) instead of the child waiting on its next line. It ends when the
pipe closes, every process holding it having exited, once what it read is written.
"""

from __future__ import annotations

import argparse
import codecs
import logging
import queue
import signal
import sys
import threading
from logging.handlers import RotatingFileHandler
from pathlib import Path

# Kept light (the standard library only): a relay starts beside every process start.

logger = logging.getLogger(__name__)

QUEUED_BYTES = 64 << 20  # what may wait for the disk before lines are dropped
# A longer line reaches the log in pieces of this size (a rollover may fall between them).
LOG_LINE_LIMIT = 16 << 10


class _Handler(RotatingFileHandler):
    """Reports writes that fail (a full disk) once until one succeeds again, instead of
    a traceback per line."""

    failing = False
    _failed = False

    def emit(self, record: logging.LogRecord) -> None:
        self._failed = False
        super().emit(record)  # calls handleError if the write failed
        if not self._failed:
            self.failing = False

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        self._failed = True
        if not self.failing:
            self.failing = True
            logger.warning("cannot write %s; its lines are dropped until it can",
                           self.baseFilename, exc_info=True)


class ChildLog:
    """One process's log file, rolled over by size by the standard library's
    RotatingFileHandler: <name>.log, then .log.1 up to .log.<files - 1>, so it never
    takes more than files x max_bytes. The process does not write the file itself (it
    could not follow a rollover): it writes into a pipe that its log relay copies into
    the file line by line, so no line is lost when the file rolls over, and a full disk
    drops lines instead of blocking the process. `settings`: the deployment's
    `supervision` (log_max_bytes, log_files)."""

    def __init__(self, path: Path | str, settings=None, *, max_bytes: int = 0, files: int = 2):
        self.path = path
        if settings is not None:
            max_bytes, files = int(settings.log_max_bytes), settings.log_files
        self._handler = _Handler(path, maxBytes=max_bytes, backupCount=files - 1,
                                 encoding="utf-8", errors="replace")
        self._handler.terminator = ""  # what is written carries its own line ends

    def write(self, text: str) -> None:
        # handle() takes the handler's lock: a banner and the copied lines never
        # interleave within a line.
        self._handler.handle(logging.makeLogRecord({"msg": text}))

    def close(self) -> None:
        self._handler.close()


_END = object()  # the pipe closed


def relay(pipe, log: ChildLog, queued_bytes: int = QUEUED_BYTES) -> None:
    """Copy `pipe` (binary, line by line) into `log` until it closes."""
    lines: queue.SimpleQueue = queue.SimpleQueue()
    lock = threading.Lock()
    queued, dropped = [0], [0]  # bytes waiting, lines dropped (changed under `lock`)

    def read() -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while line := pipe.readline(LOG_LINE_LIMIT):
            with lock:
                if queued[0] + len(line) > queued_bytes:
                    dropped[0] += 1
                    continue
                queued[0] += len(line)
            lines.put(decoder.decode(line))
        lines.put(_END)

    reader = threading.Thread(target=read, name="read", daemon=True)
    reader.start()
    reported, ended = 0, False
    while not ended:
        batch, item = [], lines.get()
        while item is not _END:
            batch.append(item)  # and what came meanwhile, written at once
            if sum(map(len, batch)) >= LOG_LINE_LIMIT:
                break
            try:
                item = lines.get_nowait()
            except queue.Empty:
                break
        ended = item is _END
        with lock:
            queued[0] -= sum(len(text.encode("utf-8", "replace")) for text in batch)
            lost = dropped[0]
        if lost != reported:
            log.write(f"[epd-serve log relay: {lost - reported} lines dropped: the log "
                      "file could not be written as fast as they came]\n")
            reported = lost
        if batch:
            log.write("".join(batch))
    reader.join()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("max_bytes", type=int)
    parser.add_argument("files", type=int)
    parser.add_argument("--banner", default="", help="written first")
    args = parser.parse_args(argv)
    # Its process group's signals are not for it: it ends when its pipe closes, so the
    # last words of a process that was stopped reach the log.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log = ChildLog(args.log, max_bytes=args.max_bytes, files=args.files)
    try:
        if args.banner:
            log.write(args.banner)
        relay(sys.stdin.buffer, log)
    finally:
        log.close()


if __name__ == "__main__":
    main()
