"""Every hand-off struct survives a round trip through the JSON body it travels in; a
field missing, renamed or of the wrong type is refused naming it; an unknown version of
our own parameters is refused."""

from __future__ import annotations

import typing

import msgspec
import pytest

from epd_serve.connectors.epd_kv.grouping import MODES
from epd_serve.protocols import ascend_layerwise, encoder, epd_push, mooncake_pull
from epd_serve.protocols.params import ParamsError, from_dict, to_dict

# One filled-in instance of every struct (every field set, so every one is checked).
SAMPLES = [
    epd_push.Steering(epd_mode="layer", epd_fault="stall"),
    epd_push.PrefillParams(transfer_id="t1", epd_mode="group", epd_fault="fail_write"),
    epd_push.DecodeParams(transfer_id="t1", remote_host="10.0.0.2", remote_port=30101),
    epd_push.TransferReport(transfer_id="t1", outcome="done", reason="", mode="group",
                            bytes=65536, groups=2, transfer_ms=0.5, exposed_ms=0.0,
                            prefill_ms=3.0, handoff_ms=0.7),
    mooncake_pull.PrefillParams(transfer_id="t2"),
    mooncake_pull.DecodeParams(remote_bootstrap_addr="http://10.0.0.1:8900",
                               remote_engine_id="engine-p0", transfer_id="t2"),
    mooncake_pull.BootstrapWorker(engine_id="engine-p0"),
    ascend_layerwise.DecodeParams(metaserver="http://10.0.0.9:8000/v1/metaserver/abc"),
    ascend_layerwise.BlocksReport(
        token_ids=[], request_id="chatcmpl-x", remote_block_ids=[[7, 8, 9]],
        remote_block_size=[128], remote_engine_id="engine-d1", remote_host="10.0.0.3",
        remote_port=30000, remote_tp_size=1, remote_pcp_size=1, remote_dcp_size=1,
        remote_cached_tokens=0),
    encoder.ItemParams(metadata={"image_grid_thw": [1, 4, 4]}, item_indices=[0, 2]),
]
ids = [type(s).__module__.rsplit(".", 1)[-1] + "." + type(s).__name__ for s in SAMPLES]


def fields(struct) -> list[msgspec.structs.FieldInfo]:
    return list(msgspec.structs.fields(type(struct)))


def checked(struct) -> list[str]:
    """The fields whose loss a reader notices: all of them where it refuses keys it
    does not name (our own parameters), else the required ones."""
    strict = type(struct).__struct_config__.forbid_unknown_fields
    return [f.encode_name for f in fields(struct) if strict or f.required]


@pytest.mark.parametrize("sample", SAMPLES, ids=ids)
def test_round_trip_through_json(sample):
    body = msgspec.json.decode(msgspec.json.encode({"params": to_dict(sample)}))
    assert from_dict(type(sample), body["params"], "params") == sample


def test_every_struct_of_every_protocol_module_has_a_sample():
    modules = (ascend_layerwise, encoder, epd_push, mooncake_pull)
    structs = {v for m in modules for v in vars(m).values()
               if isinstance(v, type) and issubclass(v, msgspec.Struct)
               and v.__module__ == m.__name__}
    assert structs == {type(s) for s in SAMPLES}


@pytest.mark.parametrize("sample", SAMPLES, ids=ids)
def test_a_required_field_removed_or_renamed_is_refused_naming_it(sample):
    sent = to_dict(sample)
    required = {f.encode_name for f in fields(sample) if f.required}
    assert checked(sample), "a struct of hand-off parameters checks nothing?"
    for name in checked(sample):
        removed = {k: v for k, v in sent.items() if k != name}
        renamed = {**removed, name + "_renamed": sent[name]}
        if name in required:
            with pytest.raises(ParamsError, match=f"missing required field `{name}`"):
                from_dict(type(sample), removed, "kv_transfer_params")
        # A strict reader names the key it does not know, the others the one missing.
        with pytest.raises(ParamsError, match=f"(unknown field `{name}_renamed`"
                                              f"|missing required field `{name}`)"):
            from_dict(type(sample), renamed, "kv_transfer_params")


@pytest.mark.parametrize("sample", SAMPLES, ids=ids)
def test_a_field_of_the_wrong_type_is_refused_naming_its_path(sample):
    sent = to_dict(sample)
    for info in fields(sample):
        if info.encode_name not in sent:
            continue
        broken = {**sent, info.encode_name: object_of_another_type(sent[info.encode_name])}
        with pytest.raises(ParamsError) as err:
            from_dict(type(sample), broken, "kv_transfer_params")
        assert str(err.value).startswith("kv_transfer_params: ")
        assert f"`$.{info.encode_name}`" in str(err.value)


def object_of_another_type(value):
    return [value] if not isinstance(value, list) else "not a list"


@pytest.mark.parametrize("kind", [epd_push.PrefillParams, epd_push.DecodeParams,
                                  epd_push.TransferReport])
def test_our_own_parameters_carry_a_version_and_an_unknown_one_is_refused(kind):
    sample = next(s for s in SAMPLES if type(s) is kind)
    sent = to_dict(sample)
    assert sent[epd_push.VERSION_KEY] == epd_push.VERSION
    with pytest.raises(ParamsError, match=r"Invalid enum value 2 - at `\$.epd_v`"):
        from_dict(kind, {**sent, epd_push.VERSION_KEY: 2}, "kv_transfer_params")


def test_parameters_read_by_vllms_connectors_carry_no_key_of_ours():
    """vLLM and vllm-ascend read these: exactly their keys, nothing they might choke on."""
    assert set(to_dict(SAMPLES[4])) == {"do_remote_decode", "do_remote_prefill",
                                        "transfer_id"}
    assert set(to_dict(SAMPLES[5])) == {"do_remote_decode", "do_remote_prefill",
                                        "remote_bootstrap_addr", "remote_engine_id",
                                        "transfer_id"}
    assert set(to_dict(SAMPLES[7])) == {"do_remote_decode", "do_remote_prefill", "metaserver"}


def test_unset_fields_are_left_out_and_a_refusal_names_its_reason():
    assert to_dict(epd_push.PrefillParams(transfer_id="t")) == {
        "epd_v": 1, "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "t"}
    assert to_dict(epd_push.refusal("kv_transfer_params: x")) == {
        "epd_v": 1, "outcome": "refused", "reason": "kv_transfer_params: x"}


def test_the_modes_a_client_may_ask_for_are_the_connectors():
    assert typing.get_args(epd_push.Mode) == MODES


def test_encoder_params_are_refused_naming_the_entry_field():
    with pytest.raises(ParamsError, match=r"ec_transfer_params: .*`\$\[\.\.\.\]\.metadata`"):
        from_dict(encoder.EncoderParams, {"h": {"metadata": [], "item_indices": [0]}},
                  "ec_transfer_params")
    with pytest.raises(ParamsError, match="missing required field `item_indices`"):
        from_dict(encoder.EncoderParams, {"h": {"metadata": {}}}, "ec_transfer_params")
