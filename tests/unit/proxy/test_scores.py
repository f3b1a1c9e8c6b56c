"""The routing policy a deployment file may give a stage: a preset name or scorer
weights, checked at start-up against the one registry (proxy/scores.py), and the
normalisations the scorers share."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from epd_serve.proxy import config, scores
from epd_serve.proxy.config import ProxyConfig, ProxySettings, RoutingSettings

REPO = Path(__file__).resolve().parents[3]


def test_a_stage_takes_scorer_weights_or_a_preset():
    settings = ProxySettings.model_validate(yaml.safe_load("""
        routing:
          E: {hash-affinity: 1, least-loaded: 0.5}
          P: least-loaded
    """))
    assert settings.routing.E == {"hash-affinity": 1.0, "least-loaded": 0.5}
    assert settings.routing.P == "least-loaded" and settings.routing.D == "least-loaded"
    # The launcher hands the proxy its settings as JSON: the weights survive it.
    cfg = ProxyConfig(model="m", instances=[], routing=settings.routing)
    again = ProxyConfig.model_validate(json.loads(cfg.model_dump_json()))
    assert again.routing == settings.routing


def test_every_scorer_a_file_may_name_is_implemented():
    from epd_serve.proxy.routing import SCORE

    assert SCORE.keys() == scores.SCORERS.keys()


def test_the_presets_accepted_are_the_registrys():
    assert set(typing.get_args(config.Preset)) == set(scores.PRESETS)
    for name in scores.PRESETS:
        if not scores.PRESETS[name].affinity:
            assert RoutingSettings(E=name, P=name, D=name).P == name


def test_an_unknown_scorer_is_refused_naming_it_and_the_known_ones():
    with pytest.raises(ValidationError, match="unknown scorer 'least-busy'") as err:
        RoutingSettings(E={"least-busy": 1})
    assert all(name in str(err.value) for name in scores.SCORERS)


def test_an_unknown_preset_is_refused():
    with pytest.raises(ValidationError, match="least-loaded"):
        RoutingSettings(D="fastest")


@pytest.mark.parametrize("weights, message", [
    ({"least-loaded": -1}, ">= 0"),
    ({"least-loaded": float("nan")}, ">= 0"),
    ({"least-loaded": 0, "size-weighted": 0}, "at least one"),
    ({}, "at least one"),
])
def test_weights_are_non_negative_and_not_all_zero(weights, message):
    with pytest.raises(ValidationError, match=message):
        RoutingSettings(E=weights)


@pytest.mark.parametrize("stage", ["P", "D"])
def test_hash_affinity_is_refused_for_prefill_and_decode_also_inside_weights(stage):
    for policy in ("hash-affinity", {"least-loaded": 1, "hash-affinity": 0.1}):
        with pytest.raises(ValidationError, match=f"routing.{stage}: hash-affinity"):
            RoutingSettings(**{stage: policy})
    # Weighted nothing, it does nothing.
    assert RoutingSettings(**{stage: {"least-loaded": 1, "hash-affinity": 0}})


def test_the_shipped_weighted_example_is_valid():
    dep = yaml.safe_load((REPO / "configs/cpu/2e-pd.yaml").read_text())
    routing = ProxySettings.model_validate(dep["proxy"]).routing
    assert isinstance(routing.E, dict) and scores.resolve(routing.E).affinity


def test_relative_scores_the_least_load_1_and_twice_the_work_half():
    assert scores.relative([0, 1, 3], own=1) == [1.0, 0.5, 0.25]
    assert scores.relative([5, 5], own=1) == [1.0, 1.0]
    assert scores.relative([0, 0], own=0) == [1.0, 1.0]  # a hop of no size counts as one


def test_by_rank_halves_down_the_order():
    assert scores.by_rank([7, 30, 2]) == [0.5, 1.0, 0.25]
    assert scores.by_rank([3]) == [1.0]
