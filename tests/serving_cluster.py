"""The in-process cluster the serving tests use: deploy.LocalCluster plus request helpers."""

from __future__ import annotations

import dataclasses
import time

import grpc

from deploy import LocalCluster, cluster_config_from_dict
from model import kv_fingerprint
from protos import halfmoon_pb2 as pb
from protos import halfmoon_pb2_grpc as pb_grpc
from servekit import kv_cache_layout
from servekit.worker import torch_dtype


def wait_for(check, timeout_s: float, what: str) -> float:
    """Poll `check` until true; the seconds it took (AssertionError naming `what` if never)."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


class Cluster:
    """`with Cluster(lm) as c: c.generate(...)`: deploy.LocalCluster in this process, sharing `lm`;
    every server on 127.0.0.1, free ports, all stopped on exit. `hosts` store nodes stand for
    hosts; workers are spread over them in turn (prefill-i and decode-i on store-(i % hosts)).
    `cluster` holds top-level cluster config keys (kv_cache_dtype...), shared by every server.
    The servers named in `processes` run in processes of their own (killable; not in the
    `stores`/`prefills`/`decodes` lists, which hold the in-process ones)."""

    def __init__(
        self,
        lm,
        num_prefill: int = 1,
        num_decode: int = 1,
        prefill: dict | None = None,
        decode: dict | None = None,
        conductor: dict | None = None,
        store: dict | None = None,
        hosts: int = 1,
        cluster: dict | None = None,
        processes: tuple[str, ...] = (),
    ):
        self.lm = lm
        self.channel = None
        cfg = cluster_config_from_dict(
            {
                "model": lm.name,
                "dtype": str(lm.model.dtype).removeprefix("torch."),
                "prefill_workers": num_prefill,
                "decode_workers": num_decode,
                "store": {"dram_bytes": 128 << 20, "heartbeat_s": 0.5, **(store or {})},
                "prefill": dict(prefill or {}),
                "decode": dict(decode or {}),
                "conductor": {"load_poll_s": 0.05, **(conductor or {})},
                **(cluster or {}),
            }
        )
        if "model_fingerprint" not in (store or {}):
            # the store refuses blocks of any other model or KV layout than the cluster's
            layout = kv_cache_layout(lm.config, cfg.conductor, torch_dtype(cfg.dtype))
            fingerprint = kv_fingerprint(lm.weights_id, layout)
            cfg.store = dataclasses.replace(cfg.store, model_fingerprint=fingerprint)
        self.local = LocalCluster(cfg, lm=lm, hosts=hosts, processes=set(processes))
        try:
            self.address = self.local.start()
            self.redis = self.local.redis
            self.stores = self.local.objects["store"]
            self.store = self.stores[0]
            self.store_address = self.store.address
            self.prefills = self.local.objects["prefill"]
            self.decodes = self.local.objects["decode"]
            # None when the conductor runs in a process of its own
            self.conductor = next(iter(self.local.objects["conductor"]), None)
            self.channel = grpc.insecure_channel(self.address)
            self.stub = pb_grpc.ConductorStub(self.channel)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.local.stop()

    def generate(
        self, timeout: float = 120.0, **fields
    ) -> tuple[list[int], str, pb.GenerateResponse]:
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
            if all(
                ld.running == 0 and ld.waiting == 0 and ld.free_blocks == ld.total_blocks
                for ld in loads
            ):
                return
            time.sleep(0.02)
        raise TimeoutError("decode workers still busy")


def request(
    token_ids=None,
    text=None,
    messages=None,
    max_tokens=16,
    ignore_eos=True,
    temperature=0.0,
    stop=(),
    **extra,
) -> pb.GenerateRequest:
    """A GenerateRequest from one of token_ids, text, messages (greedy, EOS ignored unless
    asked)."""
    r = pb.GenerateRequest(
        sampling=pb.SamplingParams(
            max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos, stop=list(stop)
        ),
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
