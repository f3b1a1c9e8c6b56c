"""The shared-memory segments a killed tree leaves: read from /proc/<pid>/maps lines,
only multiprocessing's `psm_` names in the shared-memory folder, and removed only where
no running process maps them any more. Real files and a real mapping of this process;
the folder is a temporary one standing in for /dev/shm."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from epd_serve.runtime.shm_leftovers import mapped_segments, release, segment_of

SHM = Path("/dev/shm")


def test_a_maps_line_names_a_psm_segment_in_the_shared_memory_folder_only():
    line = "7f0000000000-7f0000100000 rw-s 00000000 00:1a 1234    /dev/shm/psm_1a2b3c4d\n"
    assert segment_of(line) == SHM / "psm_1a2b3c4d"
    # Already unlinked: nothing to remove.
    assert segment_of(line.rstrip("\n") + " (deleted)\n") is None
    # Not multiprocessing's: our MM Store's arena, a torch file, a library, anonymous.
    for path in ("/dev/shm/epd-mmstore-cpu-e-p-d-8990.arena", "/dev/shm/torch_12_34",
                 "/tmp/psm_lookalike", "/usr/lib/libc.so.6", "[heap]"):
        assert segment_of(f"7f00-7f01 r--p 00000000 00:1a 1 {path}\n") is None, path
    assert segment_of("7f00-7f01 rw-p 00000000 00:00 0\n") is None
    # A path with spaces stays whole.
    assert segment_of("7f00-7f01 rw-s 0 00:1a 1 /dev/shm/psm_a b\n") == SHM / "psm_a b"


def test_release_removes_what_nothing_maps_and_keeps_what_a_running_process_maps(tmp_path):
    orphan, in_use = tmp_path / "psm_orphan", tmp_path / "psm_in_use"
    for path in (orphan, in_use):
        path.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(in_use, "r+b") as f, mmap.mmap(f.fileno(), 0) as mapping:
        mapping[:4] = b"ring"
        assert mapped_segments([os.getpid()], tmp_path) == {in_use}
        gone = tmp_path / "psm_gone"  # its owner removed it meanwhile: not an error

        assert release({orphan, in_use, gone}, tmp_path) == [orphan]

        assert not orphan.exists() and in_use.exists()
    assert release({in_use}, tmp_path) == [in_use]  # unmapped now
    assert not in_use.exists()


def test_a_process_that_is_gone_maps_nothing():
    assert mapped_segments([2**22 + 12345]) == set()  # above the default pid_max
