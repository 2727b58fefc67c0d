"""KServe v2 / Triton over gRPC (grpc.aio), with the protos generated in tritonclient.grpc.

The servicer subclasses the generated `GRPCInferenceServiceServicer`. Methods are registered from
the service descriptor with a deserializer that never raises: a request that is not valid protobuf
is answered INVALID_ARGUMENT by the method itself, rather than an opaque INTERNAL from grpc.
Tracing and log settings answer UNIMPLEMENTED.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from ..errors import SartorError
from .errors import InvalidRequest, ServeError
from .shared_memory import ShmInput, ShmRef, shm_ref
from .tensors import array_from_bytes, check_shape, element_count, kserve_datatype, numpy_dtype

log = logging.getLogger("sartor.serve")
SERVICE = "inference.GRPCInferenceService"
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                  "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                  "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
                  "FP64": "fp64_contents"}
IMPLEMENTED = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
               "ModelStreamInfer", "ModelConfig", "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad",
               "RepositoryModelUnload", "SystemSharedMemoryStatus", "SystemSharedMemoryRegister",
               "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
               "CudaSharedMemoryUnregister")


class _Malformed:
    def __init__(self, kind: str, error: Exception) -> None:
        self.message = f"malformed {kind}: {' '.join(str(error).split()) or type(error).__name__}"


def safe_deserializer(cls):
    def deserialize(data: bytes):
        try:
            return cls.FromString(data)
        except Exception as exc:  # DecodeError, RecursionError, ...
            return _Malformed(cls.DESCRIPTOR.name, exc)
    return deserialize


def tensor_shm_ref(tensor, where: str) -> ShmRef | None:
    """The shared-memory parameters of a request tensor (input or requested output), or None."""
    if not any(key.startswith("shared_memory_") for key in tensor.parameters):
        return None
    return shm_ref({k: _param(v) for k, v in tensor.parameters.items()}, where)


def decode_inputs(request: pb.ModelInferRequest) -> dict:
    """name -> np.ndarray, or ShmInput for an input in shared memory. As tritonclient sends them,
    raw_input_contents holds one entry per input that is not in shared memory, in order."""
    raw = request.raw_input_contents
    if not request.inputs:
        raise InvalidRequest("the request has no inputs")
    refs = [tensor_shm_ref(t, f"input {t.name!r}") for t in request.inputs]
    in_body = sum(ref is None for ref in refs)
    if raw and len(raw) != in_body:
        raise InvalidRequest(f"raw_input_contents holds {len(raw)} entries for {in_body} inputs not in shared memory")
    inputs: dict = {}
    next_raw = 0
    for i, (tensor, ref) in enumerate(zip(request.inputs, refs)):
        if not tensor.name:
            raise InvalidRequest(f"input {i} has no name")
        where = f"input {tensor.name!r}"
        if tensor.name in inputs:
            raise InvalidRequest(f"{where} is given twice")
        dtype = numpy_dtype(tensor.datatype, where)
        shape = check_shape(list(tensor.shape), where)
        if ref is not None:
            if tensor.HasField("contents") and tensor.contents.ByteSize():
                raise InvalidRequest(f"{where} has both contents and shared_memory_region")
            inputs[tensor.name] = ShmInput(ref, shape, dtype)
            continue
        if raw:
            if tensor.HasField("contents") and tensor.contents.ByteSize():
                raise InvalidRequest(f"{where} has both contents and raw_input_contents")
            inputs[tensor.name] = array_from_bytes(raw[next_raw], shape, dtype, where)
            next_raw += 1
            continue
        field = CONTENTS_FIELD.get(tensor.datatype)
        if field is None:
            raise InvalidRequest(f"{where}: datatype {tensor.datatype} must be sent in raw_input_contents")
        values = getattr(tensor.contents, field)
        if len(values) != element_count(shape):
            raise InvalidRequest(f"{where}: {len(values)} values in contents.{field} for shape {list(shape)} "
                                 f"(expected {element_count(shape)})")
        array = np.asarray(values)
        if dtype.kind in "iu" and array.size:
            info = np.iinfo(dtype)
            if array.min() < info.min or array.max() > info.max:
                raise InvalidRequest(f"{where}: contents are out of range for datatype {tensor.datatype}")
        inputs[tensor.name] = array.astype(dtype).reshape(shape)
    return inputs


def _internal(exc: Exception) -> str:
    return " ".join(f"internal error: {type(exc).__name__}: {exc}".split())


def _param(value: pb.InferParameter):
    kind = value.WhichOneof("parameter_choice")
    return getattr(value, kind) if kind else None


class GrpcFrontend(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, core) -> None:
        self.core = core

    # ---- health and metadata --------------------------------------------------------------------------
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.core.live())

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.core.ready())

    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self.core.repository.is_ready(request.name, request.version or None))

    async def ServerMetadata(self, request, context):
        return json_format.ParseDict(self.core.server_metadata(), pb.ServerMetadataResponse())

    async def ModelMetadata(self, request, context):
        model = self.core.repository.served(request.name, request.version or None)
        return json_format.ParseDict(model.metadata(), pb.ModelMetadataResponse())

    async def ModelConfig(self, request, context):
        model = self.core.repository.served(request.name, request.version or None)
        return pb.ModelConfigResponse(config=model.config)

    async def ModelStatistics(self, request, context):
        stats = self.core.statistics(request.name or None, request.version or None)
        return json_format.ParseDict({"model_stats": stats}, pb.ModelStatisticsResponse())

    # ---- repository -----------------------------------------------------------------------------------
    async def RepositoryIndex(self, request, context):
        rows = self.core.repository.index(ready_only=request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**row) for row in rows])

    async def RepositoryModelLoad(self, request, context):
        await asyncio.get_running_loop().run_in_executor(None, self.core.load_model, request.model_name)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request, context):
        await asyncio.get_running_loop().run_in_executor(None, self.core.unload_model, request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ---- shared memory ---------------------------------------------------------------------------------
    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def SystemSharedMemoryStatus(self, request, context):
        rows = self.core.shared_memory.status("system", request.name or None)
        return pb.SystemSharedMemoryStatusResponse(
            regions={r["name"]: pb.SystemSharedMemoryStatusResponse.RegionStatus(**r) for r in rows})

    async def SystemSharedMemoryRegister(self, request, context):
        await self._off_loop(self.core.shared_memory.register_system, request.name, request.key, request.offset,
                             request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        await self._off_loop(self.core.shared_memory.unregister, "system", request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request, context):
        rows = self.core.shared_memory.status("cuda", request.name or None)
        return pb.CudaSharedMemoryStatusResponse(
            regions={r["name"]: pb.CudaSharedMemoryStatusResponse.RegionStatus(**r) for r in rows})

    async def CudaSharedMemoryRegister(self, request, context):
        await self._off_loop(self.core.shared_memory.register_cuda, request.name, request.raw_handle,
                             request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request, context):
        await self._off_loop(self.core.shared_memory.unregister, "cuda", request.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()

    # ---- inference ------------------------------------------------------------------------------------
    async def _infer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        if not request.model_name:
            raise InvalidRequest("the request names no model")
        inputs = decode_inputs(request)
        outputs, regions = [], {}
        for o in request.outputs:
            if "classification" in o.parameters:
                raise InvalidRequest(f"output {o.name!r}: the classification extension is not supported")
            if o.name in outputs:
                raise InvalidRequest(f"output {o.name!r} is requested twice")
            outputs.append(o.name)
            ref = tensor_shm_ref(o, f"output {o.name!r}")
            if ref is not None:
                regions[o.name] = ref
        params = {k: _param(v) for k, v in request.parameters.items()}
        if params.get("sequence_id") not in (None, 0, ""):
            raise InvalidRequest("parameter sequence_id is not supported (no sequence batching)")
        remaining = context.time_remaining() if context is not None else None
        outcome = await self.core.infer(request.model_name, request.model_version or None, inputs, outputs or None,
                                        params.get("timeout"), remaining, output_regions=regions)
        response = pb.ModelInferResponse(model_name=outcome.model.name, model_version=outcome.model.version,
                                         id=request.id)
        for name, array in outcome.outputs.items():
            response.outputs.add(name=name, datatype=kserve_datatype(array.dtype.name), shape=list(array.shape))
            if name in outcome.shared_memory:
                # No data, and an empty raw entry: as Triton does, raw_output_contents keeps one entry
                # per output, so that a client finds the others at their index.
                response.raw_output_contents.append(b"")
                continue
            array = np.ascontiguousarray(array)
            response.raw_output_contents.append(array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes())
        return response

    async def ModelInfer(self, request, context):
        return await self._infer(request, context)

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests of one stream run concurrently (and batch together); responses come back as they
        complete, each carrying its request's id. An error is a response with error_message; the
        stream goes on."""
        responses: asyncio.Queue = asyncio.Queue()
        running: set = set()

        async def answer(request) -> None:
            if isinstance(request, _Malformed):
                await responses.put(pb.ModelStreamInferResponse(error_message=request.message))
                return
            try:
                response = pb.ModelStreamInferResponse(infer_response=await self._infer(request, None))
            except SartorError as exc:
                response = pb.ModelStreamInferResponse(error_message=str(exc),
                                                       infer_response=pb.ModelInferResponse(id=request.id))
            except Exception as exc:
                log.exception("gRPC stream inference failed")
                response = pb.ModelStreamInferResponse(error_message=_internal(exc),
                                                       infer_response=pb.ModelInferResponse(id=request.id))
            await responses.put(response)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    task = asyncio.ensure_future(answer(request))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:
                    await asyncio.gather(*list(running), return_exceptions=True)
            finally:
                await responses.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                response = await responses.get()
                if response is None:
                    break
                yield response
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()


async def _unimplemented(request, context):
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not supported by sartor serve (tracing and log settings are "
                                                       "not implemented)")


def wrap_unary_handler(method):
    async def handler(request, context):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return await method(request, context)
        except grpc.aio.AbortError:
            raise
        except ServeError as exc:
            await context.abort(grpc.StatusCode[exc.grpc_code], str(exc))
        except SartorError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("gRPC method failed")
            await context.abort(grpc.StatusCode.INTERNAL, _internal(exc))
    return handler


def generic_handler(servicer: GrpcFrontend):
    """The service's method handlers, built from the generated descriptor (see the module docstring)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        kwargs = {"request_deserializer": safe_deserializer(request_cls),
                  "response_serializer": response_cls.SerializeToString}
        if method.name == "ModelStreamInfer":
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(servicer.ModelStreamInfer, **kwargs)
        elif method.name in IMPLEMENTED:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(wrap_unary_handler(getattr(servicer, method.name)),
                                                                        **kwargs)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(_unimplemented, **kwargs)
    return grpc.method_handlers_generic_handler(SERVICE, handlers)
