"""DeviceTier: how a worker's own paged KV pool offers its resident blocks as the top tier."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class DeviceTier(ABC):
    """Blocks resident in a worker's paged pool, by key. The prefill worker implements this; a
    StoreClient given one asks it first, so its blocks are the fastest hits."""

    name = "device"

    @abstractmethod
    def lookup(self, keys: list[bytes]) -> int:
        """How many leading keys are resident."""
        ...

    @abstractmethod
    def get_into(self, keys: list[bytes], out: torch.Tensor) -> int:
        """Copy the leading resident blocks into out[:k] ([n, L, 2, T, H, D]); k."""
        ...
