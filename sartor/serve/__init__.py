"""`sartor serve`: a KServe v2 / Triton-compatible inference server for sartor engines.

The top layer: it uses the runtime (engines, contexts), the data layer (image preprocessing) and the
validate layer (detection decoders); nothing below imports it. One concern per module:

| module | what it does |
|---|---|
| `config.py` | config.pbtxt (protobuf text) -> ModelConfig, completed from the engine; ModelSettings |
| `repository.py` | the Triton-layout repository: load, warm up, swap versions, unload, poll |
| `batcher.py` | the bounded queue, dynamic batching, worker threads per execution context |
| `core.py` | what both frontends call: metadata, inference (retry across swaps, timeouts), stats |
| `http_codec.py` | KServe v2 JSON + binary tensor data request/response bodies |
| `http_frontend.py` | the HTTP/REST routes (aiohttp) and the metrics endpoint |
| `grpc_frontend.py` | the gRPC servicer (grpc.aio) on tritonclient's generated protos |
| `image.py` | the image route: preprocessing and detection decoding |
| `metrics.py` | Prometheus text format, Triton's metric names |
| `shared_memory.py` | Triton's system and CUDA shared-memory regions: registry, leases, reads and writes |
| `tensors.py` | KServe datatypes, arrays from JSON lists or raw bytes |
| `errors.py` | request errors and their HTTP / gRPC codes |
| `server.py` | the event loop, the endpoints, start/stop |
| `frontend_pool.py` | `--frontends N`: the frontend processes, their ports, restarts, and the main side of their channels |
| `workers.py` | one frontend process: HTTP and gRPC on shared ports, inference handed to the main process |
| `ipc.py` | the frontend channel: framed JSON headers plus raw tensors, replies and errors |
| `shards.py` | `--engine-processes K`: K whole servers on the same ports, started, restarted, metrics summed |
| `peers.py` | what keeps those K in step: registrations, loads and unloads everywhere, statistics summed |

It needs the serve extra (`pip install 'sartor[serve]'`), checked here so that a missing package is
one line naming it rather than a traceback from whichever module imports it first.
"""
from ..extras import require_extra

require_extra("serve", "sartor serve")

from .server import Server, ServeOptions

__all__ = ["ServeOptions", "Server"]
