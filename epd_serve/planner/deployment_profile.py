"""Profiling a deployment file: bring it up, measure it (profiler.py), stop it, and
record the machine it ran on. A monolithic deployment gives engine costs and budgets,
a split one the hand-offs' costs; `quick` does both with fewer samples and saves the
result where `plan`, `simulate` and `sim_vs_real` look for a profile by name.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from epd_serve.bench.timings import SLO
from epd_serve.planner import machine, profiler
from epd_serve.planner import profile as profiles
from epd_serve.planner.profile import Profile

# The deployments a quick profile of a CPU host measures (run from the project root).
QUICK_ENGINE_CONFIG = "configs/cpu/tp1.yaml"
QUICK_HANDOFF_CONFIG = "configs/cpu/e-p-d.yaml"


@dataclasses.dataclass(frozen=True)
class Effort:
    """How many samples a profile takes."""

    repeats: int = 3  # per engine probe (the median is kept)
    max_tokens: int = 2048  # largest prefill probe
    handoff_requests: int = 40  # per hand-off run
    handoff_runs: int = 3  # hand-off runs pooled
    max_images: int = 8  # largest encoder batch searched
    max_seqs: int = 32  # largest decode batch searched


# 3 min 33 s on 2 CPUs (Intel Xeon, no AMX): TP1's start-up and engine probes 55 s,
# E-P-D's start-up 48 s, one hand-off run of 30 requests at 0.25 req/s about 2 min.
QUICK = Effort(repeats=3, max_tokens=2048, handoff_requests=30, handoff_runs=1)


def engine_profile(config: str, base: Profile, slo: SLO, effort: Effort,
                   name: str | None = None, log: Callable[[str], None] = print) -> Profile:
    """`base` with the engine costs and budgets of the monolithic (EPD) instance of the
    deployment in `config`: started, measured through its proxy, stopped."""
    from epd_serve.runtime import bringup

    dep = bringup.load(config)
    if _monolithic(dep) is None:
        raise ValueError(f"{config} has no instance that runs every stage: engine costs are "
                         f"measured on one (e.g. {QUICK_ENGINE_CONFIG})")
    launcher = bringup.bring_up(dep)
    try:
        return measure_engine(dep, base, slo, effort, config, name, log)
    finally:
        launcher.stop()


def measure_engine(dep, base: Profile, slo: SLO, effort: Effort, config: str,
                   name: str | None = None, log: Callable[[str], None] = print) -> Profile:
    """The engine profile of a running deployment's monolithic instance, with this
    machine (and the engines' versions) recorded. `config`: the file it came from."""
    from epd_serve.bench import workloads
    from epd_serve.runtime.progress import allows_videos

    target = _monolithic(dep)
    prober = profiler.Prober(dep.proxy_url, target.served_model_name, effort.repeats, log=log)
    prof = profiler.measure(prober, base, slo, effort.max_tokens, effort.max_images,
                            effort.max_seqs, videos=allows_videos(dep.config.engine_args))
    texts = [s.text for preset in ("tiny-mm", "text", "visualwebinstruct")
             for s in workloads.load_workload(preset, 50, 1)]
    per_word, template = profiler.text_tokens(str(dep.model_dir), texts)
    return prof.model_copy(update={
        "tokens_per_word": round(per_word, 3), "template_tokens": template,
        "name": name or f"{dep.config.platform}-{target.served_model_name}",
        "platform": dep.config.platform, "model": target.served_model_name,
        "machine": machine.this_machine(dep.config.platform, target.engine_python),
        "source": f"measured by `epd-serve profile {config}`: engine costs of {target.name} "
                  f"through the proxy of {dep.plan.to_notation()}, {effort.repeats} repeats "
                  "per probe"})


def _monolithic(dep):
    """The deployment's instance that runs every stage, if any."""
    return next((l for l in dep.launches if set(l.instance.roles) == set("EPD")), None)


def handoff_profile(config: str, engine: Profile, slo: SLO, effort: Effort,
                    name: str | None = None, console=None) -> Profile:
    """`engine` with the hand-offs' costs of the split deployment in `config` (E -> P
    features, P -> D KV), measured with load runs through its proxy."""
    from epd_serve.runtime import bringup

    dep = bringup.load(config)
    if not profiler.splits_prefill_decode(dep.plan):
        raise ValueError(f"{config} hands nothing from prefill to decode: hand-offs are "
                         f"measured on a split deployment (e.g. {QUICK_HANDOFF_CONFIG})")
    launcher = bringup.bring_up(dep)
    try:
        prof = profiler.measure_handoffs(engine, dep, slo, effort.handoff_requests,
                                         runs=effort.handoff_runs, console=console)
    finally:
        launcher.stop()
    launch = dep.launches[0]
    return prof.model_copy(update={
        "name": name or prof.name,
        "machine": machine.this_machine(dep.config.platform, launch.engine_python),
        "source": f"{prof.source}; measured by `epd-serve profile {config}`: hand-offs of "
                  f"{dep.plan.to_notation()} (engine costs from {engine.name})"})


def quick(base: Profile, slo: SLO, engine_config: str = QUICK_ENGINE_CONFIG,
          handoff_config: str | None = QUICK_HANDOFF_CONFIG, effort: Effort = QUICK,
          console=None) -> tuple[Profile, Path]:
    """A profile of this machine in a few minutes: engine costs on `engine_config`,
    hand-offs on `handoff_config`; saved as <local profiles>/<platform>-<model>.yaml,
    where a profile's name finds it before the shipped one. Shows each step and the
    time taken on stderr."""
    from rich.console import Console

    console = console or Console(stderr=True)
    started = time.monotonic()
    steps = 2 if handoff_config else 1

    def log(line: str) -> None:
        elapsed = time.monotonic() - started
        console.print(f"[dim]{int(elapsed // 60)}:{int(elapsed % 60):02d}[/dim] {line}")

    log(f"[bold]quick profile, step 1/{steps}[/bold]: engine costs on {engine_config} "
        f"(start-up, then prefill, decode, image and video probes, {effort.repeats} each)")
    prof = engine_profile(engine_config, base, slo, effort, log=log)
    if handoff_config:
        log(f"[bold]quick profile, step 2/{steps}[/bold]: hand-offs on {handoff_config} "
            f"({effort.handoff_requests} requests at 0.25 req/s)")
        prof = handoff_profile(handoff_config, prof, slo, effort, console=console)
    prof.source = f"quick profile: {prof.source}"
    path = profiles.save(prof, profiles.local_dir() / f"{prof.name}.yaml")
    prof = profiles.load(path)  # as plan will read it
    log(f"[bold]quick profile done[/bold]: {path} (plan, simulate and sim_vs_real find it "
        f"as --profile {prof.name})")
    return prof, path
