from .onnx import ImportedModel, import_model_proto, import_onnx

__all__ = ["ImportedModel", "import_model_proto", "import_onnx"]
