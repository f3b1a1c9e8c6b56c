"""Feed engine command lines through the installed vLLM's own parser and config classes.

Runs inside the Python environment of the engine being checked (`python -m
epd_serve.runtime.engine_probe < launches.json`), which may hold another vLLM release than the
one epd-serve runs beside: it imports nothing of epd-serve at module level and looks
vLLM's entry points up where each release keeps them. Reads a JSON list of
{"config", "instance", "platform", "device_type", "argv", "env", ...} (argv: the engine's arguments after
the program and its model, e.g. after `vllm serve MODEL`) and writes one JSON report:
the engine's version, and per launch the flags it rejected and what it could not check.

A launch goes through the same steps as `vllm serve`: the argument parser (every
unknown flag and every bad value, not only the first), the serve-argument validation,
the engine arguments, the KV and EC connector classes resolved by the engine's own
factories (a registered name, or our module path) and checked to be concrete
subclasses of that release's base class, the VLLM_* environment variables against the
engine's table of them, and, where the model exists on this machine and a platform is
detected, the full engine configuration.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

# Where each vLLM release keeps what we need (newest first).
ARGPARSE_MODULES = ("vllm.utils.argparse_utils", "vllm.utils")
SERVE_ARG_MODULES = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")
KV_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
KV_BASE = ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1")
EC_FACTORY = "vllm.distributed.ec_transfer.ec_connector.factory"
EC_BASE = ("vllm.distributed.ec_transfer.ec_connector.base", "ECConnectorBase")
ATTENTION_BACKENDS = ("vllm.v1.attention.backends.registry", "vllm.attention.backends.registry")
# vllm-ascend registers its KV connectors in this file; importing it needs CANN.
ASCEND_REGISTRY_FILE = ("distributed", "kv_transfer", "__init__.py")

FLAG_IN_MESSAGE = re.compile(r"argument (--[\w-]+)")


class ParseError(Exception):
    """argparse refused a value (raised instead of printing usage and exiting)."""


def _first_attr(modules: tuple[str, ...], name: str) -> Any:
    errors = []
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            errors.append(f"{module}: {err}")
    raise ImportError(f"{name} not found ({'; '.join(errors)})")


class Engine:
    """The installed vLLM (and vllm-ascend), looked up once."""

    def __init__(self, platform: str, device_type: str):
        self.platform = platform
        self.device_type = device_type  # what vLLM calls the platform's device
        self.notes: list[dict[str, str]] = []
        self.ascend_version: str | None = None
        if platform == "ascend" and importlib.util.find_spec("torch_npu") is None:
            # vllm-ascend's plugins import torch_npu, which needs CANN: without it the
            # engine is checked with plugins off and vllm-ascend read from its source.
            os.environ["VLLM_PLUGINS"] = ""
        import vllm

        self.version = getattr(vllm, "__version__", "unknown")
        self._stand_in_platform()
        # vllm-ascend's source folder: its registrations, version and variables are read there.
        self.ascend_dir = _ascend_package_dir() if platform == "ascend" else None
        if self.ascend_dir is not None:
            self._register_ascend(self.ascend_dir)
        parser_cls = _first_attr(ARGPARSE_MODULES, "FlexibleArgumentParser")
        self.make_arg_parser = _first_attr(SERVE_ARG_MODULES, "make_arg_parser")
        try:
            self.validate_serve_args = _first_attr(SERVE_ARG_MODULES, "validate_parsed_serve_args")
        except ImportError:
            self.validate_serve_args = None
        self.parser = self.make_arg_parser(parser_cls())
        self.parser.error = _raise_parse_error  # report, do not print usage and exit
        from vllm import envs

        self.env_names = set(envs.environment_variables) | self._ascend_env_names()
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.engine_args_cls = AsyncEngineArgs

    def _stand_in_platform(self) -> None:
        """Without the platform's device vLLM detects no platform, and even the parser's
        defaults need one: stand in vLLM's CPU platform, and say so."""
        import vllm.platforms as platforms
        from vllm.platforms.interface import UnspecifiedPlatform

        if not isinstance(platforms.current_platform, UnspecifiedPlatform):
            return
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
        self.notes.append({"what": f"{self.platform} defaults and the engine configuration",
                           "reason": f"no {self.platform} device here: vLLM's CPU platform "
                                     "stood in, so device-dependent defaults were not checked"})

    # -- vllm-ascend ---------------------------------------------------------
    def _register_ascend(self, package_dir: Path) -> None:
        """Register vllm-ascend's connectors as its plugin does; without CANN, read the
        registrations from its source and check their modules exist."""
        version_file = package_dir / "_version.py"
        if version_file.exists():
            match = re.search(r"__version__ = version = '([^']+)'", version_file.read_text())
            self.ascend_version = match.group(1) if match else None
        try:
            import vllm_ascend

            vllm_ascend.register_connector()
            return
        except Exception as err:  # torch_npu without CANN fails in many ways
            reason = f"{type(err).__name__}: {err}".splitlines()[0][:200]
        self.notes.append({"what": "vllm-ascend connector classes",
                           "reason": f"importing vllm_ascend needs CANN ({reason}); its "
                                     "connector names and modules were read from its source"})
        factory = importlib.import_module(KV_FACTORY).KVConnectorFactory
        registry_file = package_dir.joinpath(*ASCEND_REGISTRY_FILE)
        for name, module, class_name in _registrations(registry_file.read_text()):
            module_file = package_dir.parent.joinpath(*module.split(".")).with_suffix(".py")
            factory._registry[name] = _source_only_loader(name, module, class_name, module_file)

    def _ascend_env_names(self) -> set[str]:
        if self.ascend_dir is None:
            return set()
        return {name for name in _string_constants((self.ascend_dir / "envs.py").read_text())
                if name.startswith("VLLM_")}

    # -- one launch ------------------------------------------------------------
    def check(self, launch: dict[str, Any]) -> dict[str, Any]:
        rejects: list[dict[str, str]] = []
        unchecked: list[dict[str, str]] = []
        argv = list(launch["argv"])
        args = self._parse(argv, rejects)
        for name in sorted(launch.get("env", {})):
            if name.startswith("VLLM_") and name not in self.env_names:
                rejects.append({"flag": f"env {name}",
                                "message": "not an environment variable this engine reads"})
        if args is not None:
            engine_args = self._engine_args(args, rejects)
            if engine_args is not None:
                self._attention_backend(engine_args, rejects)
                self._connectors(engine_args, rejects, unchecked)
                if not rejects:  # a refused flag would only fail again here
                    self._engine_config(engine_args, launch, rejects, unchecked)
        for reject in rejects:
            reject["message"] = _short(reject["message"])
        return {"config": launch["config"], "instance": launch["instance"],
                "rejects": rejects, "unchecked": unchecked}

    def _parse(self, argv: list[str], rejects: list[dict[str, str]]) -> argparse.Namespace | None:
        """Every unknown flag and every refused value: a refused flag is reported,
        dropped with its value and the rest parsed again."""
        while True:
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    args, unknown = self.parser.parse_known_args(argv)
            except ParseError as err:
                flag = _flag_of(str(err))
                rejects.append({"flag": flag or "?", "message": str(err)})
                if flag is None or flag not in _flags(argv):
                    return None
                argv = _drop_flag(argv, flag)
                continue
            for word in unknown:
                if word.startswith("-"):
                    rejects.append({"flag": word.split("=", 1)[0],
                                    "message": "unrecognized argument"})
            if self.validate_serve_args is not None:
                try:
                    self.validate_serve_args(args)
                except (ParseError, TypeError, ValueError) as err:
                    rejects.append({"flag": _flag_of(str(err)) or "serve arguments",
                                    "message": str(err)})
            return args

    def _engine_args(self, args, rejects):
        import huggingface_hub.constants as hub

        offline = hub.HF_HUB_OFFLINE
        if not Path(args.model).exists():
            # Offline, the engine resolves the model to a local path here; a model that
            # lives only on the deployment's hosts is not a flag error.
            hub.HF_HUB_OFFLINE = False
        try:
            return self.engine_args_cls.from_cli_args(args)
        except Exception as err:
            rejects.append({"flag": _flag_of(str(err)) or "engine arguments",
                            "message": f"{type(err).__name__}: {err}"})
            return None
        finally:
            hub.HF_HUB_OFFLINE = offline

    def _attention_backend(self, engine_args, rejects) -> None:
        """The engine checks the name only when it builds its configuration, which needs
        the device: check it against the engine's table of backends here."""
        name = getattr(engine_args, "attention_backend", None)
        if not isinstance(name, str):
            return
        backends = _first_attr(ATTENTION_BACKENDS, "AttentionBackendEnum")
        if name not in backends.__members__:
            rejects.append({"flag": "--attention-backend",
                            "message": f"unknown attention backend {name!r} "
                                       f"(this engine has {', '.join(backends.__members__)})"})

    def _connectors(self, engine_args, rejects, unchecked) -> None:
        for kind, factory_module, (base_module, base_name) in (
                ("kv", KV_FACTORY, KV_BASE), ("ec", EC_FACTORY, EC_BASE)):
            config = getattr(engine_args, f"{kind}_transfer_config", None)
            if config is None:
                continue
            flag = f"--{kind}-transfer-config"
            name = getattr(config, f"{kind}_connector")
            try:
                factory = getattr(importlib.import_module(factory_module),
                                  f"{kind.upper()}ConnectorFactory")
                cls = factory.get_connector_class(config)
            except _SourceOnly as only:
                unchecked.append({"what": f"{flag} class {name}", "reason": str(only)})
                self._extra_keys(config, kind, name, [only.module_file], rejects)
                continue
            except Exception as err:
                where = getattr(config, f"{kind}_connector_module_path", None) or "registry"
                rejects.append({"flag": flag, "message": f"connector {name!r} ({where}): "
                                f"{type(err).__name__}: {err}"})
                continue
            base = getattr(importlib.import_module(base_module), base_name)
            if not (isinstance(cls, type) and issubclass(cls, base)):
                rejects.append({"flag": flag, "message": f"{name} is not a {base_name}"})
            elif inspect.isabstract(cls):
                missing = ", ".join(sorted(cls.__abstractmethods__))
                rejects.append({"flag": flag, "message": f"{name} does not implement this "
                                f"release's abstract methods: {missing}"})
            elif not cls.__module__.startswith("epd_serve."):  # ours validate their settings
                self._extra_keys(config, kind, name, _source_files(cls), rejects)

    @staticmethod
    def _extra_keys(config, kind: str, name: str, sources: list[Path], rejects) -> None:
        """An extra-config key that the files defining the connector never name is
        silently ignored by the engine (its config classes take any extra keys): report
        it."""
        extra = getattr(config, f"{kind}_connector_extra_config", None) or {}
        if not extra:
            return
        named: set[str] = set()
        for source in sources:
            named |= _string_constants(source.read_text())
        for key in sorted(set(extra) - named):
            rejects.append({"flag": f"--{kind}-transfer-config",
                            "message": f"{kind}_connector_extra_config key {key!r}: {name}'s "
                                       "code never reads it (it would be ignored)"})

    def _engine_config(self, engine_args, launch, rejects, unchecked) -> None:
        from vllm.platforms import current_platform

        if not Path(engine_args.model).exists():
            unchecked.append({"what": "engine configuration",
                              "reason": f"model {engine_args.model} is not on this machine"})
            return
        if current_platform.device_type != self.device_type:
            unchecked.append({"what": "engine configuration",
                              "reason": f"no {self.platform} device here"})
            return
        saved = {k: os.environ.get(k) for k in launch.get("env", {})}
        os.environ.update(launch.get("env", {}))
        try:
            engine_args.create_engine_config()
        except Exception as err:
            rejects.append({"flag": _flag_of(str(err)) or "engine configuration",
                            "message": f"{type(err).__name__}: {str(err)[:500]}"})
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


class _SourceOnly(Exception):
    """A connector known from vllm-ascend's source whose class needs CANN to import."""

    def __init__(self, message: str, module_file: Path):
        super().__init__(message)
        self.module_file = module_file


def _source_files(cls: type) -> list[Path]:
    """The engine's files defining a connector class and its bases."""
    files = []
    for klass in cls.__mro__:
        source = getattr(sys.modules.get(klass.__module__), "__file__", None)
        if source and klass.__module__.split(".")[0] in ("vllm", "vllm_ascend"):
            files.append(Path(source))
    return list(dict.fromkeys(files))


def _string_constants(source: str) -> set[str]:
    return {node.value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def _ascend_package_dir() -> Path:
    """Found without importing it (its import needs CANN)."""
    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("vllm-ascend is not installed in this environment")
    return Path(next(iter(spec.submodule_search_locations)))


def _source_only_loader(name: str, module: str, class_name: str, module_file: Path):
    """A registry loader for a vllm-ascend connector whose class needs CANN to import:
    it checks the module ships and defines the class, then says it stopped there."""
    def load():
        if not module_file.exists():
            raise ValueError(f"vllm-ascend registers {name} from {module}, "
                             f"which it does not ship ({module_file})")
        if not re.search(rf"^class {class_name}\b", module_file.read_text(), re.M):
            raise ValueError(f"{module} does not define {class_name}")
        raise _SourceOnly(f"registered by vllm-ascend ({module}.{class_name}, present in "
                          "its source); importing the class needs CANN", module_file)
    return load


def _registrations(source: str) -> list[tuple[str, str, str]]:
    """`KVConnectorFactory.register_connector("Name", "module", "Class")` calls in a file."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_connector" and len(node.args) == 3
                and all(isinstance(a, ast.Constant) for a in node.args)):
            found.append(tuple(a.value for a in node.args))
    return found


def _short(message: str) -> str:
    """One line, without pydantic's documentation links."""
    message = message.split("For further information")[0]
    return " ".join(message.split())[:400]


def _raise_parse_error(message: str):
    raise ParseError(message)


def _flag_of(message: str) -> str | None:
    match = FLAG_IN_MESSAGE.search(message)
    return match.group(1) if match else None


def _flags(argv: list[str]) -> set[str]:
    return {word.split("=", 1)[0] for word in argv if word.startswith("--")}


def _drop_flag(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and its value (`--flag value` or `--flag=value`)."""
    out, skip_value = [], False
    for word in argv:
        if skip_value:
            skip_value = False
            if not word.startswith("-"):
                continue
        if word == flag:
            skip_value = True
            continue
        if word.startswith(flag + "="):
            continue
        out.append(word)
    return out


def main() -> int:
    launches = json.load(sys.stdin)
    first = launches[0] if launches else {"platform": "cpu", "device_type": "cpu"}
    with contextlib.redirect_stdout(sys.stderr):  # engine logs must not mix with the report
        engine = Engine(first["platform"], first["device_type"])
        results = [engine.check(launch) for launch in launches]
    # The interpreter too: a deployment's engine_python runs the probe, not epd-serve's.
    report = {"engine": {"vllm": engine.version, "vllm_ascend": engine.ascend_version,
                         "python": sys.version.split()[0], "interpreter": sys.executable},
              "notes": engine.notes, "launches": results}
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
