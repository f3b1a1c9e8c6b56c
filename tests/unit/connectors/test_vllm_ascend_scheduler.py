"""A prefill instance on vllm-ascend uses the MM Store: vllm-ascend 0.23.0.post1's own
`schedule()` (which never calls `ensure_cache_available`) with our EC and KV
connectors, run by vllm_ascend_schedule.py in the vLLM 0.23 engine stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epd_serve.models.tinymodel import HIDDEN

from ...ports import free_port_block

REPO = Path(__file__).resolve().parents[3]
ENGINE_PYTHON = REPO / ".venv-vllm023" / "bin" / "python"
SOURCE = REPO / ".venv-vllm023" / "vllm-ascend-0.23.0.post1"
DRIVER = Path(__file__).with_name("vllm_ascend_schedule.py")


@pytest.fixture(scope="module")
def scheduled(tmp_path_factory) -> dict:
    if not (ENGINE_PYTHON.exists() and (SOURCE / "vllm_ascend").is_dir()):
        pytest.fail("needs the vLLM 0.23 engine stack and vllm-ascend's source: run "
                    "scripts/setup-vllm023.sh (scripts/test.sh does)")
    env = dict(os.environ, EPD_TEST_PORT=str(free_port_block(4, start=29400)))
    run = subprocess.run([str(ENGINE_PYTHON), str(DRIVER), str(SOURCE),
                          str(tmp_path_factory.mktemp("ascend-scheduler"))],
                         capture_output=True, text=True, timeout=300, env=env)
    if run.returncode != 0:
        sys.stderr.write(run.stderr[-6000:])
        pytest.fail(f"the scheduler run failed (exit {run.returncode})")
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_run_is_vllm_ascends_own_schedule(scheduled):
    assert scheduled["is_vllm_ascend_scheduler"], scheduled["scheduler"]
    # 0.23.0.post1's copies of schedule() (a prefill's, balance scheduling's) never ask
    # the EC connector; on the prefill it is our KV connector's None that holds a
    # request until its feature is here (vLLM's own loop, and vllm-ascend main's
    # balance copy, ask ensure_cache_available as well: the same answer twice).
    assert scheduled["prefill_asked"]["asks_ec"] == 0
    assert scheduled["balance_asked"]["asks_ec"] == 0
    assert scheduled["prefill_asked"]["kv_waits"] > 0


def test_prefill_loads_a_stored_feature_instead_of_encoding_it(scheduled):
    stored = scheduled["prefill_stored"]
    assert stored["encoded"] == [], "prefill ran its vision encoder for a stored feature"
    assert stored["loaded"] == ["stored"]
    assert stored["loaded_rows"] == {"stored": [16, HIDDEN]}


def test_prefill_encodes_a_feature_the_store_lacks(scheduled):
    missing = scheduled["prefill_missing"]
    assert missing["encoded"] == [0] and missing["loaded"] == []


def test_with_no_kv_connector_a_stored_feature_is_claimed_hinted_or_not(scheduled):
    # Balance scheduling, no KV connector of ours: nothing makes the request wait. A copy
    # the hint brought is used; one no hint brought is read as the scheduler asks
    # has_cache_item (claim_wait_s), rather than encoded again.
    hinted, not_hinted = scheduled["balance_hinted"], scheduled["balance_not_hinted"]
    assert hinted["encoded"] == [] and hinted["loaded"] == ["stored-hinted"]
    assert not_hinted["encoded"] == [] and not_hinted["loaded"] == ["stored"]
