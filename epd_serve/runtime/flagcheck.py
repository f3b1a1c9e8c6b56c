"""`epd-serve check-flags`: every engine command line the deployment files named emit,
checked by the engine that will run it.

Runs in the CLI. For each deployment file named (or each *.yaml of a folder named) it
takes exactly what `epd-serve up` and `launch --emit-shell` start (the start-up plan's
command line and environment per instance), hands them to
`epd_serve.runtime.engine_probe` running under the engine's Python (the deployment's
`engine_python`, else the one given: this one by default, or a scratch environment
holding a platform's pinned stack: scripts/check-engine-flags.sh), and reports every
flag the engine rejects by config, instance and flag, plus what the probe could not
check and why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from epd_serve.runtime import bringup
from epd_serve.runtime.plan import startup_plan

PROBE_TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Reject:
    config: str
    instance: str
    flag: str
    message: str


@dataclasses.dataclass
class Report:
    platform: str
    engine: dict[str, Any]
    rejects: list[Reject]
    checked: int  # command lines checked
    unchecked: Counter  # (what, reason) -> how many command lines

    @property
    def ok(self) -> bool:
        return not self.rejects


def deployment_files(paths: list[Path]) -> list[Path]:
    """The deployment files named: a file itself, a folder its *.yaml files (sorted).
    Whoever calls names them: the package knows no repository's folders."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(path.glob("*.yaml"))
            if not found:
                raise FileNotFoundError(f"no deployment files (*.yaml) in {path}")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or folder")
    return files


def engine_launches(config_path: Path, build_models: bool = True) -> list[dict[str, Any]]:
    """One probe entry per instance: the engine's arguments as `--model MODEL ...` (the
    program that starts the server stripped), the environment it gets, and the
    interpreter that starts it (None: the deployment names none)."""
    dep = bringup.load(config_path)
    if build_models:
        bringup.ensure_model(dep)  # tiny models are built offline in a second
    platform = dep.platform
    entries = []
    # In plan order (the start order puts instances that share a device later).
    steps = {step.name: step for step in startup_plan(dep)}
    for step in (steps[launch.name] for launch in dep.launches):
        model, command = step.launch.model, list(step.command)
        program = platform.launcher_for(step.launch)
        # `vllm serve MODEL ...` or `python -m ...api_server --model MODEL ...`
        if command[:len(program) + 1] != [*program, model]:
            raise AssertionError(f"{step.name}: command does not start with {program} MODEL")
        entries.append({"config": str(config_path), "instance": step.name,
                        "platform": platform.name, "device_type": platform.device_type,
                        "argv": ["--model", model, *command[len(program) + 1:]],
                        "env": step.env, "python": step.launch.engine_python})
    return entries


def run_probe(entries: list[dict[str, Any]], python: str = sys.executable) -> dict[str, Any]:
    """Run the probe under `python`; its environment starts from the first launch's so
    the engine detects the platform it will run on."""
    env = {**os.environ, **(entries[0]["env"] if entries else {})}
    proc = subprocess.run([python, "-m", "epd_serve.runtime.engine_probe"], input=json.dumps(entries),
                          capture_output=True, text=True, env=env, timeout=PROBE_TIMEOUT_S)
    if proc.returncode != 0 or not proc.stdout.strip():
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"the engine probe under {python} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout)


def check(configs: list[Path], python: str = sys.executable) -> list[Report]:
    """Check every config under its engine's interpreter: the deployment's
    engine_python, else `python`. One probe process per platform and interpreter (vLLM
    imports once)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for path in configs:
        for entry in engine_launches(path):
            groups.setdefault((entry["platform"], entry["python"] or python), []).append(entry)
    reports = []
    for (platform, interpreter), entries in groups.items():
        raw = run_probe(entries, interpreter)
        rejects = [Reject(r["config"], r["instance"], x["flag"], x["message"])
                   for r in raw["launches"] for x in r["rejects"]]
        unchecked = Counter((u["what"], u["reason"]) for r in raw["launches"] for u in r["unchecked"])
        for note in raw["notes"]:
            unchecked[(note["what"], note["reason"])] += len(entries)
        reports.append(Report(platform, raw["engine"], rejects, len(entries), unchecked))
    return reports


def render(reports: list[Report]) -> str:
    lines = []
    for report in reports:
        engine = ", ".join(f"{k} {v}" for k, v in report.engine.items() if v)
        verdict = "ok" if report.ok else f"{len(report.rejects)} rejected"
        lines.append(f"{report.platform}: {report.checked} command line(s) checked against "
                     f"{engine}: {verdict}")
        for r in report.rejects:
            lines.append(f"  REJECTED {r.config} {r.instance} {r.flag}: {r.message}")
        for (what, reason), count in sorted(report.unchecked.items()):
            lines.append(f"  not checked ({count}x) {what}: {reason}")
    return "\n".join(lines)


def to_json(reports: list[Report]) -> str:
    return json.dumps([{"platform": r.platform, "engine": r.engine, "checked": r.checked,
                        "rejects": [dataclasses.asdict(x) for x in r.rejects],
                        "unchecked": [{"what": w, "reason": why, "count": n}
                                      for (w, why), n in r.unchecked.items()]}
                       for r in reports], indent=2)
