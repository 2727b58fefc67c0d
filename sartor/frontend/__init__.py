from ..extras import require_extra

require_extra("build", "importing an ONNX model", ("onnx",))

from .onnx import ImportedModel, import_model_proto, import_onnx

__all__ = ["ImportedModel", "import_model_proto", "import_onnx"]
