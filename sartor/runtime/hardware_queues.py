"""How many hardware work queues CUDA gives this process's streams (CUDA_DEVICE_MAX_CONNECTIONS).

The driver spreads a process's streams over that many queues, 8 unless the variable says otherwise,
and two streams that share a queue run in turn however independent they are. A pipeline keeps a
dozen streams busy (the engine's, each worker's, each nvJPEG decoder's): a decode that lands behind
the engine's queued runs waits for them, so sartor asks for 32, the most the driver gives
(docs/decisions/0066-thirty-two-hardware-queues.md). The driver reads the variable once, when the
process starts CUDA: sartor sets it at import, unless it is set already (the user's value is kept),
CUDA has started (too late: `in_effect()` then says 8, and a pipeline warns), or the machine runs
NVIDIA's Multi-Process Service: there each client owns its queues out of the server's one pool, and
32 a process would leave fewer clients room to connect."""
from __future__ import annotations

import os

import torch

CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
WANTED_CONNECTIONS = 32
DRIVER_DEFAULT_CONNECTIONS = 8

MPS_PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
MPS_DEFAULT_PIPE = "/tmp/nvidia-mps"  # where the MPS control daemon listens unless told otherwise

_set_too_late = False  # CUDA had started in this process before sartor could ask


def mps_in_use() -> bool:
    """Whether this process's CUDA would connect to an MPS control daemon (its pipe is there)."""
    pipe = os.environ.get(MPS_PIPE_ENV) or MPS_DEFAULT_PIPE
    return os.path.exists(os.path.join(pipe, "control"))


def request_connections() -> None:
    """Ask for WANTED_CONNECTIONS queues, if the variable is unset, CUDA has not started yet and no
    MPS daemon shares the GPU."""
    global _set_too_late
    if CONNECTIONS_ENV in os.environ or mps_in_use():
        return
    if torch.cuda.is_initialized():
        _set_too_late = True
        return
    os.environ[CONNECTIONS_ENV] = str(WANTED_CONNECTIONS)


def in_effect() -> int:
    """The queues this process's CUDA runs with, as far as the variable tells."""
    if _set_too_late:
        return DRIVER_DEFAULT_CONNECTIONS
    try:
        return int(os.environ.get(CONNECTIONS_ENV, DRIVER_DEFAULT_CONNECTIONS))
    except ValueError:
        return DRIVER_DEFAULT_CONNECTIONS


def fewer_than_wanted() -> str | None:
    """Why this process's streams share fewer queues than sartor asks for, or None."""
    if _set_too_late:
        return (f"CUDA started in this process before sartor was imported, so its streams share the driver's "
                f"{DRIVER_DEFAULT_CONNECTIONS} hardware queues: the JPEG decodes then wait behind the engine's "
                f"runs. Set {CONNECTIONS_ENV}={WANTED_CONNECTIONS} before the process starts CUDA, or import sartor "
                f"first")
    return None
