import pytest

from epd_serve.planner.profile import Profile


def make_profile(**changes) -> Profile:
    """Round numbers, so that tests can do the arithmetic by hand."""
    data = dict(
        name="test", platform="cpu", model="m", source="tests",
        tokens_per_word=1.0, template_tokens=10,
        encoder=dict(fixed_ms=5.0, per_image_ms=0.0, per_token_ms=0.1),
        llm=dict(fixed_ms=10.0, per_prefill_token_ms=0.1, per_decode_seq_ms=1.0),
        transfers=dict(hop_ms=2.0, feature_fixed_ms=3.0, kv_fixed_ms=4.0),
        sharing=dict(scope="device", contention=0.0),
        memory=dict(kv_capacity_tokens=1_000_000),
    )
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return Profile.model_validate(data)


@pytest.fixture
def profile() -> Profile:
    return make_profile()
