"""Load a deployment file and bring it up: the one path the CLI, the demo, the load
tool, the benchmarks and the end-to-end tests share.

Runs in the caller's process. `load` gives a ResolvedDeployment (overrides replace keys
of the file, validated like the file itself); `bring_up` builds the tiny model where
the file asks for one, starts every process, shows start-up progress, waits until all
are healthy and warms the deployment up.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from epd_serve.deployment import schema
from epd_serve.deployment.resolve import ResolvedDeployment, resolve
from epd_serve.runtime.launcher import Launcher
from epd_serve.runtime.supervision import LaunchError

if TYPE_CHECKING:
    from epd_serve.runtime.ray_launcher import RayLauncher


def load(path: str | Path, **overrides: Any) -> ResolvedDeployment:
    """The deployment file at `path`, with `overrides` of its top-level keys; a `proxy`
    override replaces only the proxy keys it names (the file's others, such as
    stage_headers, stay)."""
    cfg, root = schema.load(path)
    if overrides:
        if isinstance(overrides.get("proxy"), dict):
            overrides = {**overrides, "proxy": {**cfg.proxy.model_dump(exclude_unset=True),
                                                **overrides["proxy"]}}
        try:
            cfg = schema.Deployment.model_validate({**cfg.model_dump(), **overrides})
        except ValidationError as err:
            raise schema.ConfigError(f"{path} with {sorted(overrides)}: "
                                     f"{err.errors()[0]['msg']}") from None
    return resolve(cfg, root)


def ensure_model(dep: ResolvedDeployment) -> None:
    """Build the tiny model where the deployment file asks for one and none exists (or
    an older builder's is there)."""
    from epd_serve.models.tinymodel import build_tiny_model, is_current_tiny_model

    if dep.config.tiny_model and not is_current_tiny_model(dep.model_dir):
        print(f"building tiny {dep.config.tiny_model} model in {dep.model_dir} ...", file=sys.stderr)
        build_tiny_model(dep.config.tiny_model, dep.model_dir)


def launcher_for(dep: ResolvedDeployment) -> Launcher | RayLauncher:
    """The launcher of one host, or the Ray launcher for a deployment with a cluster."""
    if dep.config.cluster is None:
        return Launcher(dep)
    try:
        from epd_serve.runtime.ray_launcher import RayLauncher
    except ImportError as err:
        raise LaunchError(f"{dep.config.name} spans a cluster, which runs on Ray ({err}); "
                          "install it with `pip install 'epd-serve[cluster]'`") from None
    return RayLauncher(dep)


def bring_up(dep: ResolvedDeployment, warmup: bool = True) -> Launcher | RayLauncher:
    """Start a deployment with live progress, or adopt it where an earlier `up` left it
    running (launcher.py); returns the running Launcher."""
    from epd_serve.runtime.progress import StartupProgress, warm_up

    ensure_model(dep)
    launcher = launcher_for(dep)
    if isinstance(launcher, Launcher) and launcher.adopt():
        # Its launcher was killed; the deployment kept serving. Supervised again, as
        # it is (it was warmed up when it started).
        return launcher
    try:
        launcher.start()
        with StartupProgress(dep) as progress:
            elapsed = launcher.wait_healthy(progress.update)
        print(f"deployment {dep.config.name} ({dep.plan.to_notation()}) healthy after "
              f"{elapsed:.1f}s: {dep.proxy_url}", file=sys.stderr)
        if warmup:
            warm_up(dep, operator_token=launcher.internal_token)
    except BaseException:
        launcher.stop()
        raise
    return launcher
