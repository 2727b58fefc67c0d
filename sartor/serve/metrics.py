"""Prometheus metrics in the text exposition format (version 0.0.4), named as Triton names them.

Triton's counters keep their names (no `_total` suffix): nv_inference_request_success,
nv_inference_request_failure, nv_inference_count, nv_inference_exec_count and the cumulative
durations in microseconds (nv_inference_request_duration_us, nv_inference_queue_duration_us,
nv_inference_compute_input_duration_us, nv_inference_compute_infer_duration_us,
nv_inference_compute_output_duration_us), the gauge nv_inference_pending_request_count. Added by
sartor: histograms of the batch size executed (nv_inference_batch_size), of queue and compute time
(nv_inference_queue_histogram_ms, nv_inference_compute_infer_histogram_ms), and the gauge
nv_model_device_memory_bytes (engine.device_memory_bytes per model version and device), and with
`--frontends N` the counter sartor_frontend_request_count (requests per frontend process).
"""
from __future__ import annotations

import math
import threading

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
MS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

FAMILIES = {
    "nv_inference_request_success": (COUNTER, "Number of successful inference requests, all batch sizes"),
    "nv_inference_request_failure": (COUNTER, "Number of failed inference requests, all batch sizes"),
    "nv_inference_count": (COUNTER, "Number of inferences performed (a batch of N counts N)"),
    "nv_inference_exec_count": (COUNTER, "Number of model executions performed (a batch counts 1)"),
    "nv_inference_request_duration_us": (COUNTER, "Cumulative inference request duration in microseconds"),
    "nv_inference_queue_duration_us": (COUNTER, "Cumulative inference queuing duration in microseconds"),
    "nv_inference_compute_input_duration_us": (COUNTER, "Cumulative compute input duration in microseconds"),
    "nv_inference_compute_infer_duration_us": (COUNTER, "Cumulative compute inference duration in microseconds"),
    "nv_inference_compute_output_duration_us": (COUNTER, "Cumulative inference compute output duration in "
                                                         "microseconds"),
    "nv_inference_pending_request_count": (GAUGE, "Instantaneous number of pending requests awaiting execution"),
    "nv_inference_batch_size": (HISTOGRAM, "Batch size of each model execution"),
    "nv_inference_queue_histogram_ms": (HISTOGRAM, "Time each request waited in the queue, in milliseconds"),
    "nv_inference_compute_infer_histogram_ms": (HISTOGRAM, "Time of each model execution, in milliseconds"),
    "sartor_frontend_request_count": (COUNTER, "Inference requests each frontend process passed to the main process "
                                               "(serve --frontends N), by frontend index"),
    "nv_model_device_memory_bytes": (GAUGE, "Device memory of a loaded model version: weights plus the largest "
                                            "activation arena (engine.device_memory_bytes), per device"),
}
BUCKETS = {"nv_inference_batch_size": BATCH_BUCKETS, "nv_inference_queue_histogram_ms": MS_BUCKETS,
           "nv_inference_compute_infer_histogram_ms": MS_BUCKETS}


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: tuple, extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 2**53):
        return str(int(value))
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Metrics:
    """Thread-safe counters, gauges and histograms keyed by (family, sorted label items)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[tuple, float]] = {name: {} for name in FAMILIES}
        self._histograms: dict[str, dict[tuple, list]] = {name: {} for name in BUCKETS}

    @staticmethod
    def key(labels) -> tuple:
        """The series key of a labels dict. Callers on a hot path compute it once and pass it instead
        of the dict (every method takes either)."""
        if isinstance(labels, tuple):
            return labels
        return tuple(sorted((str(k), str(v)) for k, v in labels.items()))

    _key = key

    def inc(self, name: str, labels, value: float = 1) -> None:
        key = self._key(labels)
        with self._lock:
            table = self._values[name]
            table[key] = table.get(key, 0) + value

    def inc_many(self, labels, increments: dict) -> None:
        """Several counters of one series under one lock: name -> value."""
        key = self._key(labels)
        with self._lock:
            for name, value in increments.items():
                table = self._values[name]
                table[key] = table.get(key, 0) + value

    def set(self, name: str, labels, value: float) -> None:
        with self._lock:
            self._values[name][self._key(labels)] = value

    def observe(self, name: str, labels, value: float) -> None:
        self.observe_many(name, labels, (value,))

    def observe_many(self, name: str, labels, values) -> None:
        key = self._key(labels)
        buckets = BUCKETS[name]
        with self._lock:
            entry = self._histograms[name].get(key)
            if entry is None:
                entry = self._histograms[name][key] = [[0] * len(buckets), 0.0, 0]
            counts = entry[0]
            for value in values:
                for i, bound in enumerate(buckets):
                    if value <= bound:
                        counts[i] += 1
                entry[1] += value
                entry[2] += 1

    def get(self, name: str, labels: dict) -> float:
        with self._lock:
            return self._values[name].get(self._key(labels), 0)

    def histogram(self, name: str, labels: dict) -> dict:
        """{"buckets": {bound: cumulative count}, "sum": s, "count": n} (zeros when never observed)."""
        with self._lock:
            entry = self._histograms[name].get(self._key(labels))
            counts, total, count = entry if entry else ([0] * len(BUCKETS[name]), 0.0, 0)
            return {"buckets": dict(zip(BUCKETS[name], list(counts))), "sum": total, "count": count}

    def forget(self, name: str, labels: dict) -> None:
        """Drop one gauge series (a model version that was unloaded)."""
        with self._lock:
            self._values[name].pop(self._key(labels), None)

    def render(self) -> str:
        lines = []
        with self._lock:
            for name, (kind, help_text) in FAMILIES.items():
                lines.append(f"# HELP {name} {help_text}")
                lines.append(f"# TYPE {name} {kind}")
                if kind == HISTOGRAM:
                    for key, (counts, total, count) in sorted(self._histograms[name].items()):
                        for bound, n in zip(BUCKETS[name], counts):
                            le = 'le="' + _number(float(bound)) + '"'
                            lines.append(f"{name}_bucket{_labels(key, le)} {n}")
                        le = 'le="+Inf"'
                        lines.append(f"{name}_bucket{_labels(key, le)} {count}")
                        lines.append(f"{name}_sum{_labels(key)} {_number(total)}")
                        lines.append(f"{name}_count{_labels(key)} {count}")
                else:
                    for key, value in sorted(self._values[name].items()):
                        lines.append(f"{name}{_labels(key)} {_number(value)}")
        return "\n".join(lines) + "\n"
