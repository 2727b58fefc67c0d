"""Frames in, results out: decode (JPEG on the GPU through nvJPEG, other formats and the CPU through
libjpeg-turbo/libpng), the engine's stored preprocessing applied with torch on the engine's device
straight into its bound input buffer, and the engine run, with the next batch decoded while the
current one runs. `Pipeline` is the one entry point; video files are a source too (`VideoSource`:
PyAV on CPU threads, NVDEC when PyNvVideoCodec is installed), several decoded at once by
`ConcurrentStreams`."""
from .decode import DecodedFrame, decode_frames
from .detections import Detections, EngineNms, YoloNms
from .pipeline import Pipeline, PipelineResult
from .prepare import prepare_batch
from .sources import FrameSource, read_sources
from .streams import ConcurrentStreams
from .video import VideoSource

__all__ = ["ConcurrentStreams", "DecodedFrame", "Detections", "EngineNms", "YoloNms", "FrameSource", "Pipeline", "PipelineResult", "decode_frames", "prepare_batch",
           "VideoSource", "read_sources"]
