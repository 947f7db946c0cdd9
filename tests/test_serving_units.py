"""Small pieces of the serving packages without servers: incremental text, the device tier, configs."""

from __future__ import annotations

import pytest
import torch

from conductor import ConductorConfig, IncrementalText, config_from_dict, config_from_yaml
from decode_node import DecodeConfig
from model import load_model
from prefill_node import DevicePrefixCache, PrefillConfig


@pytest.fixture(scope="module")
def tok():
    return load_model("tiny-random").tokenizer


def test_incremental_text_matches_whole_decode(tok):
    text = "héllo wörld, ünïcode ✓ and more"
    ids = tok.encode(text)
    inc = IncrementalText(tok.decode)
    parts = [inc.add([t]) for t in ids] + [inc.finish()]
    assert "".join(parts) == tok.decode(ids)
    assert all("\ufffd" not in p for p in parts)  # half a character is never sent


def test_incremental_text_cuts_stop_strings(tok):
    ids = tok.encode("one two STOP three")
    inc = IncrementalText(tok.decode, stop=["STOP"])
    out = ""
    for t in ids:
        out += inc.add([t])
        if inc.stopped:
            break
    out += inc.finish()
    assert inc.stopped and out == "one two "


def test_device_cache_pins_and_evicts_children_first():
    kv = torch.arange(8.0).reshape(8, 1)
    dc = DevicePrefixCache(kv)
    keys = [b"a", b"b", b"c"]
    assert dc.insert(keys, [5, 6, 7]) == []
    assert dc.insert([b"a"], [1]) == [1]  # already held: the caller keeps its block
    assert dc.match([b"a", b"b", b"x"]) == [5, 6]
    assert dc.evict(3) == [7]  # a and b are pinned
    dc.release([b"a", b"b"])
    assert dc.evict(1) == [6]  # the child before its parent
    out = torch.zeros(2, 1)
    assert dc.lookup([b"a", b"b"]) == 1 and dc.get_into([b"a"], out) == 1 and out[0, 0] == 5.0


def test_configs_from_dicts_and_yaml(tmp_path):
    cfg = config_from_dict(PrefillConfig, {"worker_id": "p9", "chunk_size": 64})
    assert cfg.worker_id == "p9" and cfg.chunk_size == 64
    with pytest.raises(ValueError, match="unknown field"):
        config_from_dict(DecodeConfig, {"num_blokcs": 4})
    with pytest.raises(ValueError, match="chunk_size"):
        PrefillConfig(chunk_size=20)
    path = tmp_path / "c.yaml"
    path.write_text("conductor:\n  policy: load_balance\n  prefill_workers: [127.0.0.1:1]\n")
    c = config_from_yaml(ConductorConfig, path, "conductor")
    assert c.policy == "load_balance" and c.prefill_workers == ["127.0.0.1:1"]
