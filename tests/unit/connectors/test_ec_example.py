"""The file-based EC connector (vLLM's ECExampleConnector, ours with log lines) never
turns a feature id into a path unless it is hash-shaped: vLLM takes a request's `uuid`
as the id, and the stock connector joins it onto its storage folder as given. Runs
vLLM's own connector code (vLLM 0.32, installed for the CPU backend)."""

from __future__ import annotations

import pytest
import torch

from epd_serve.connectors.ec_example import EPDExampleECConnector, safe_feature_id

KEY = "0123456789abcdef" * 4  # the shape of the proxy's keys (and of vLLM's hashes)


@pytest.fixture
def connector(tmp_path):
    """The connector as vLLM builds it, minus the engine: its storage folder, a producer
    and a consumer at once (kv_both-like)."""
    storage = tmp_path / "ec_cache"
    storage.mkdir()
    conn = object.__new__(EPDExampleECConnector)
    conn._storage_path = str(storage)
    conn._is_producer = conn._is_consumer = True
    conn._mm_datas_need_loads = {}
    return conn, storage, tmp_path


@pytest.mark.parametrize("bad", ["../../outside", "/etc/cron.d/x", "..", "a/b", "",
                                 "0123456789abcdef/../../x", "short"])
def test_an_id_that_is_not_a_hash_is_neither_written_nor_looked_for(connector, bad):
    conn, storage, root = connector
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    assert not conn._found_match_for_mm_data(bad)
    conn.save_caches({bad: torch.ones(4, 8)}, bad)
    # Nothing was made anywhere: not outside the storage folder, not inside it.
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before
    with pytest.raises(ValueError, match="not a hash"):
        conn._generate_foldername_debug(bad)


def test_a_hash_is_saved_inside_the_storage_folder_and_found_again(connector):
    conn, storage, _ = connector
    assert safe_feature_id(KEY) and not conn._found_match_for_mm_data(KEY)
    conn.save_caches({KEY: torch.ones(4, 8)}, KEY)
    assert (storage / KEY / "encoder_cache.safetensors").is_file()
    assert conn._found_match_for_mm_data(KEY)
