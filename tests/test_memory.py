"""Memory: each server reports what it holds resident against what it was configured to hold,
`halfmoon status` shows it, and a restarted store does not make its whole SSD tier resident."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
from serving_cluster import Cluster

from client.status_cmd import format_status, memory_rows
from kvstore.node.ssd import SsdTier
from model import load_model
from protos import halfmoon_pb2 as pb
from servekit import memory_usage, tensor_bytes


def mapped_resident(path: str) -> int:
    """Bytes of `path`'s pages resident in this process's mappings."""
    path = os.path.realpath(path)
    return sum(m.rss for m in psutil.Process().memory_maps() if m.path == path)


def test_a_restarted_ssd_tier_finds_its_blocks_without_reading_them(tmp_path):
    block = 256 << 10
    tier = SsdTier(str(tmp_path), 64 << 20)
    for i in range(48):  # 12 MiB of blocks, each with a parent
        parent = (i - 1).to_bytes(16, "little") if i else None
        tier.put(i.to_bytes(16, "little"), bytes([i]) * block, parent)
    tier.close()
    again = SsdTier(str(tmp_path), 64 << 20)
    try:
        found = sorted(again.scan())
        assert len(found) == 48 and all(size == block for _, size, _ in found)
        assert found[5][2] == (4).to_bytes(16, "little")
        # only B-tree pages came in, not the 12 MiB of values (a scan that read each value
        # made a restarted node's whole tier resident: 527 MiB of a 555 MiB tier)
        assert mapped_resident(os.path.join(tmp_path, "data.mdb")) < 2 << 20
        assert again.get((7).to_bytes(16, "little")) == bytes([7]) * block
    finally:
        again.close()


def test_a_tier_written_before_sizes_were_kept_is_measured_once(tmp_path):
    tier = SsdTier(str(tmp_path), 16 << 20)
    tier.put(b"a" * 16, b"x" * 5000, None)
    tier.put(b"b" * 16, b"y" * 7000, b"a" * 16)
    with tier.env.begin(write=True) as txn:  # as an older version left it: no sizes table rows
        txn.drop(tier.sizes, delete=False)
    assert sorted(tier.scan()) == [(b"a" * 16, 5000, None), (b"b" * 16, 7000, b"a" * 16)]
    with tier.env.begin() as txn:
        assert txn.stat(tier.sizes)["entries"] == 2  # recorded for the next restart
    tier.close()


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


def test_workers_and_stores_report_memory_against_their_configuration(lm):
    with Cluster(lm, decode={"num_blocks": 96}, prefill={"num_blocks": 80}) as c:
        reply = c.stub.Status(pb.StatusRequest(), timeout=30)
        rows = dict(memory_rows(reply))
        assert set(rows) == {"conductor", "prefill-0", "decode-0", c.store.cfg.node_id}
        weights = tensor_bytes(*lm.model.parameters(), *lm.model.buffers())
        for worker, blocks in (("prefill-0", 80), ("decode-0", 96)):
            pool = c.local.objects[worker.split("-")[0]][0].pool
            assert pool.num_blocks == blocks
            assert rows[worker].configured_bytes == weights + pool.bytes()
        assert rows[c.store.cfg.node_id].configured_bytes == 128 << 20  # its DRAM slab
        here = memory_usage()  # every server runs in this process: the same figures, near
        for m in rows.values():
            assert 0 < m.uss_bytes <= m.pss_bytes <= m.rss_bytes
            assert abs(m.rss_bytes - here.rss) < 0.2 * here.rss
        text = format_status(reply)
        assert "pss/configured" in text and "decode-0" in text.split("pss/configured")[1]
        # the load the conductor polls does not read /proc
        load = c.decodes[0].load()
        assert not load.HasField("memory")


def test_loading_a_model_leaves_symbolic_shapes_and_sympy_unimported():
    # Module.to_empty's empty_like goes through torch._refs, whose first call imports torch.fx's
    # symbolic shapes and sympy: ~35 MiB of Python objects in every worker for nothing it uses
    code = (
        "import sys; from model import load_model; lm = load_model('tiny-random'); "
        "assert lm.model.norm.device.type == 'cpu'; "
        "shapes = 'torch.fx.experimental.symbolic_shapes'; "
        "print(sorted(m for m in ('sympy', shapes) if m in sys.modules))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
