"""An in-process cluster for tests and benchmarks: embedded Redis, one store node, workers, a conductor (no Ray)."""

from __future__ import annotations

import dataclasses
import tempfile
import time

import grpc

from conductor import Conductor, ConductorConfig
from decode_node import DecodeConfig, DecodeWorker
from kvstore import EmbeddedRedis, StoreConfig, StoreNode
from prefill_node import PrefillConfig, PrefillWorker
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc


class Cluster:
    """`with Cluster(lm) as c: c.generate(...)`; every server on 127.0.0.1, free ports, all stopped on exit."""

    def __init__(
        self,
        lm,
        num_prefill: int = 1,
        num_decode: int = 1,
        prefill: dict | None = None,
        decode: dict | None = None,
        conductor: dict | None = None,
        store: dict | None = None,
    ):
        self.lm = lm
        self._stack: list = []
        try:
            self.redis = EmbeddedRedis()
            self._stack.append(self.redis)
            self._tmp = tempfile.TemporaryDirectory(prefix="halfmoon-test-")
            store_cfg = dict(node_id="store-0", redis_url=self.redis.url, dram_bytes=128 << 20,
                             model_fingerprint=lm.fingerprint, heartbeat_s=0.5)
            store_cfg.update(store or {})
            self.store = StoreNode(StoreConfig(**store_cfg))
            self.store_address = self.store.start()
            self._stack.append(self.store)
            common = dict(model=lm.name, store_address=self.store_address, store_node="store-0")
            self.prefills = []
            for i in range(num_prefill):
                cfg = PrefillConfig(worker_id=f"prefill-{i}", index_url=self.redis.url, **common, **(prefill or {}))
                w = PrefillWorker(cfg, lm=lm)
                w.start()
                self._stack.append(w)
                self.prefills.append(w)
            self.decodes = []
            for i in range(num_decode):
                w = DecodeWorker(DecodeConfig(worker_id=f"decode-{i}", **common, **(decode or {})), lm=lm)
                w.start()
                self._stack.append(w)
                self.decodes.append(w)
            ccfg = ConductorConfig(
                model=lm.name, prefill_workers=[w.address for w in self.prefills],
                decode_workers=[w.address for w in self.decodes], store_addresses=[self.store_address],
                index_url=self.redis.url, load_poll_s=0.05,
            )
            self.conductor = Conductor(dataclasses.replace(ccfg, **(conductor or {})), lm=lm)
            self.address = self.conductor.start()
            self._stack.append(self.conductor)
            self.channel = grpc.insecure_channel(self.address)
            self.stub = pb_grpc.ConductorStub(self.channel)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        while self._stack:
            self._stack.pop().stop()
        if getattr(self, "_tmp", None) is not None:
            self._tmp.cleanup()

    def generate(self, timeout: float = 120.0, **fields) -> tuple[list[int], str, pb.GenerateResponse]:
        """(token ids, text, the final message) of one request built from GenerateRequest fields."""
        ids, text, last = [], [], None
        for msg in self.stub.Generate(request(**fields), timeout=timeout):
            ids.extend(msg.token_ids)
            text.append(msg.text)
            last = msg
        return ids, "".join(text), last

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no decode worker runs or waits for a sequence and published blocks are freed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            loads = [d.load() for d in self.decodes]
            if all(ld.running == 0 and ld.waiting == 0 and ld.free_blocks == ld.total_blocks for ld in loads):
                return
            time.sleep(0.02)
        raise TimeoutError("decode workers still busy")


def request(
    token_ids=None, text=None, messages=None, max_tokens=16, ignore_eos=True, temperature=0.0, stop=(), **extra
) -> pb.GenerateRequest:
    """A GenerateRequest from one of token_ids, text, messages (greedy, EOS ignored unless asked)."""
    r = pb.GenerateRequest(
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos, stop=list(stop)),
        **extra,
    )
    if token_ids is not None:
        r.token_ids.ids.extend(token_ids)
    elif text is not None:
        r.text = text
    elif messages is not None:
        for m in messages:
            r.chat.messages.add(role=m["role"], content=m["content"])
    return r
