"""What the two workers share beyond the neutral core: their common config, loading the model
onto its device, the worker's gRPC server, and the request-to-sampling conversions. Imports
torch and the model; the store node and the conductor never import it."""

from servekit.worker.config import WorkerConfig
from servekit.worker.model import WorkerModel, load_worker_model
from servekit.worker.sampling import (
    check_device,
    check_dtype_device,
    resolve_device,
    sampling_params,
    torch_dtype,
)
from servekit.worker.server import WorkerServer
from servekit.worker.switch import SwitchableWorker

__all__ = [
    "WorkerConfig",
    "WorkerModel",
    "SwitchableWorker",
    "WorkerServer",
    "check_device",
    "check_dtype_device",
    "load_worker_model",
    "resolve_device",
    "sampling_params",
    "torch_dtype",
]
