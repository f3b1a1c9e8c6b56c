"""Properties of the EC connector's scheduler side under any sequence of events
(hypothesis): features stored in every form a writer could leave (right, another
image's size, another width, an integer dtype, torn bytes, three dimensions), requests
that name them with or without their pixels, allocations, steps and finishes in any
order, and bugs of ours. Whatever the sequence: no exception leaves the connector, and
every feature a step hands the workers becomes a tensor of exactly the rows and width
the model takes (a wrong one is encoded here or fails its request instead)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_serve.connectors.epd_ec.codec import to_tensor
from epd_serve.connectors.epd_ec.connector import EPDECConnector
from epd_serve.connectors.epd_ec.scheduler import EPDECScheduler
from epd_serve.connectors.epd_ec.settings import Settings
from epd_serve.mmstore import FeatureMeta, open_store

from .test_epd_ec import GRID, feature, request, step

ROWS, WIDTH = 4, 8
KEYS = ["k0", "k1", "k2"]
FORMS = {
    "right": ((ROWS, WIDTH), "float32", ROWS * WIDTH * 4),
    "other rows": ((ROWS + 2, WIDTH), "float32", (ROWS + 2) * WIDTH * 4),
    "other width": ((ROWS, WIDTH * 2), "float32", ROWS * WIDTH * 8),
    "integers": ((ROWS, WIDTH), "int32", ROWS * WIDTH * 4),
    "torn": ((ROWS, WIDTH), "bfloat16", ROWS * WIDTH),
    "three dims": ((ROWS, WIDTH, 1), "float32", ROWS * WIDTH * 4),
    "no dtype": ((ROWS, WIDTH), "nonsense", ROWS * WIDTH * 4),
}

put = st.tuples(st.just("put"), st.sampled_from(KEYS), st.sampled_from(sorted(FORMS)))
arrive = st.tuples(st.just("arrive"), st.integers(0, 3), st.sampled_from(KEYS), st.booleans())
alloc = st.tuples(st.just("alloc"), st.integers(0, 3))
finish = st.tuples(st.just("finish"), st.integers(0, 3))
bug = st.tuples(st.just("bug"), st.sampled_from(["ensure_cache_available",
                                                 "update_state_after_alloc",
                                                 "build_connector_meta"]))
events = st.lists(st.one_of(put, arrive, alloc, finish, bug), max_size=15)


def connector(store_spec) -> EPDECConnector:
    model = SimpleNamespace(hf_config=SimpleNamespace(
        vision_config=SimpleNamespace(), text_config=SimpleNamespace(hidden_size=WIDTH)))
    sched = EPDECScheduler(SimpleNamespace(model_config=model),
                           Settings(store=store_spec, load_timeout_s=0.5), False, True)
    sched.resolver._cache["image"] = {"image_grid_thw"}
    facade = object.__new__(EPDECConnector)  # the facade, no vLLM config
    facade.scheduler, facade.worker = sched, None
    return facade


def check(plan) -> set[str]:
    """The features the step hands the workers, each checked as the model takes it."""
    for key, load in plan.loads.items():
        tensor = to_tensor(load.data, load.meta, "cpu")
        assert tuple(tensor.shape) == (ROWS, WIDTH) and tensor.is_floating_point(), key
    return set(plan.loads)


def settled(ec, req) -> bool:
    """Ask as vLLM does, pass after pass, until the scheduler decides: True (schedule
    it), False (it failed)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if ec.ensure_cache_available(req, 0):
            return True
        if req.request_id in ec.scheduler._unavailable:
            return False
        time.sleep(0.005)
    raise AssertionError(f"no decision on {req.request_id}")


def test_a_right_feature_is_handed_on_and_no_wrong_one_is(store_spec):
    """The property's two sides seen once each: a stored feature of the right form is
    loaded; one of another width is not (the request has its pixels: encoded here)."""
    ec = connector(store_spec)
    try:
        with open_store(store_spec) as store:
            for key, form in (("good", "right"), ("wide", "other width")):
                shape, dtype, nbytes = FORMS[form]
                store.put(key, np.zeros(nbytes, np.uint8), FeatureMeta(shape, dtype, GRID))
            for n, key in enumerate(("good", "wide")):
                req = request(f"q{n}", feature(key, pixels=True))
                req.get_num_encoder_embeds = lambda index: ROWS
                assert settled(ec, req)
                ec.update_state_after_alloc(req, 0)
            assert check(ec.build_connector_meta(step())) == {"good"}
            assert ec.scheduler.recorder.take()["events"]["encoded_locally"] == 1
    finally:
        ec.scheduler.shutdown()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(events=events)
def test_no_sequence_raises_and_every_feature_handed_on_fits_the_model(store_spec, events):
    ec = connector(store_spec)
    live: dict[int, SimpleNamespace] = {}
    loaded: set[str] = set()
    try:
        with open_store(store_spec) as store:
            for event in events:
                if event[0] == "put":
                    _, key, form = event
                    shape, dtype, nbytes = FORMS[form]
                    store.delete(key)
                    store.put(key, np.zeros(nbytes, np.uint8), FeatureMeta(shape, dtype, GRID))
                elif event[0] == "arrive" and event[1] not in live:
                    _, n, key, pixels = event
                    live[n] = request(f"r{n}", feature(key, pixels=pixels))
                    live[n].get_num_encoder_embeds = lambda index: ROWS
                    ec.ensure_cache_available(live[n], 0)
                elif event[0] == "alloc" and event[1] in live:
                    req = live[event[1]]
                    if settled(ec, req):
                        ec.has_cache_item(req.mm_features[0].identifier)
                        ec.update_state_after_alloc(req, 0)
                    loaded.update(check(ec.build_connector_meta(step())))
                elif event[0] == "finish" and event[1] in live:
                    ec.request_finished(live.pop(event[1]))
                    check(ec.build_connector_meta(step(f"r{event[1]}")))
                elif event[0] == "bug":
                    break_once(ec.scheduler, event[1])
            check(ec.build_connector_meta(step(*(f"r{n}" for n in live))))
            for key in KEYS:
                store.delete(key)
    finally:
        ec.scheduler.shutdown()


def break_once(scheduler, method: str) -> None:
    real = getattr(scheduler, method)

    def broken(*args, **kwargs):
        setattr(scheduler, method, real)
        raise RuntimeError(f"a bug in {method}")

    setattr(scheduler, method, broken)
