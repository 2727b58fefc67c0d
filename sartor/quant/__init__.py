"""INT8: calibration (observers, threshold methods, cache), the INT8 precision plan and the
rewrite of INT8 layers into QConv/QGemm (`sartor/ops/quantized.py`)."""
from .cache import (
           CalibrationCache,
           CalibrationCacheError,
           StaleCalibrationCacheError,
           read_cache,
           write_cache,
)
from .calibrate import CalibrationError, calibrate, collect_histograms
from .calibrators import METHODS, compute_amax
from .observers import HistogramObserver
from .quantize import quantize_graph

__all__ = ["METHODS", "CalibrationCache", "CalibrationCacheError", "CalibrationError", "HistogramObserver",
           "StaleCalibrationCacheError", "calibrate", "collect_histograms", "compute_amax", "quantize_graph",
           "read_cache", "write_cache"]
