"""Shared test set-up: Triton kernels run in the interpreter when there is no GPU."""

import os

import pytest
import torch
from ports import free_port_run

if not torch.cuda.is_available():
    # Must be set before any @triton.jit decorator runs, i.e. before kernels/ is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now and the kernel will not hand out."""
    return free_port_run(1)


# One torch thread per test process: with 2 cores shared by servers and test code, a second
# intra-op thread only waits for a time slice (measured 5-10 ms stalls per op under load).
torch.set_num_threads(1)
