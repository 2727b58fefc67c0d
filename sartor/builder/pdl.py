"""--pdl: the layers whose kernel takes part in programmatic dependent launch
(`kernels/common/pdl.py`) are marked to be launched with it: INT8 (FP8) layers on sartor's own
kernels (for the resident-window tiles, their GEMM after the pixel packing), FP16 (BF16)
convolutions on the implicit GEMM or the depthwise kernel, convolution chains on their kernel, and max
pools and nearest upsamples on theirs: a kernel that does not take part ends the overlap on both of its
sides. The layers that run another tactic (the emulation, cuDNN, cuBLAS, im2col, the pixel windows'
implicit-GEMM tiles: kernels that do not wait for their predecessor as PDL requires) keep the ordinary
launch.

Without the flag (`BuildConfig.pdl` None) a quantized build on such a device times the engine both
ways and keeps PDL where it wins (`check_programmatic_launch`; docs/decisions/0055); `--no-pdl`
never marks a layer."""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import ConfigError
from ..ir import Graph
from ..ir.dtypes import QUANTIZED_LAYERS
from ..kernels.common.pdl import MIN_CAPABILITY, pdl_available
from ..ops.quantized import own_kernel_tactic
from .engine_timing import MARGIN as PDL_MARGIN, fastest_alternating, untimed_option



# The ops whose tactics may be kernels that take part (own_kernel_tactic): the quantized layers, the
# float convolution, whose implicit-GEMM tiles are the INT8 layers' kernel, the convolution chains, and
# the max pools and nearest upsamples between them (a detector's SPPF and neck).
PDL_LAYERS = frozenset(QUANTIZED_LAYERS) | {"FusedConv", "ConvChain", "MaxPool", "Resize", "Upsample"}


def check_pdl_device(device: torch.device) -> None:
    """--pdl on a device without it is refused, before the build's long stages."""
    if not pdl_available(device):
        major, minor = MIN_CAPABILITY
        raise ConfigError(f"--pdl (programmatic dependent launch) needs a CUDA device of compute capability "
                          f"{major}.{minor} or newer and a Triton with grid dependency control; {device} has not")


def mark_programmatic_launch(graph: Graph) -> int:
    """Mark (attrs["pdl"]) the layers (PDL_LAYERS) whose chosen kernel takes part at some profile (at a
    profile that runs another tactic the op launches as usual: it applies the mark to these kernels
    only); returns how many."""
    marked = 0
    for node in graph.nodes:
        if node.op_type not in PDL_LAYERS:
            continue
        tactics = node.attrs.get("tactic_by_profile") or [node.attrs.get("tactic")]
        if any(own_kernel_tactic(tactic) for tactic in tactics):
            node.attrs["pdl"] = True
            marked += 1
    return marked


def clear_programmatic_launch(graph: Graph) -> None:
    for node in graph.nodes:
        node.attrs.pop("pdl", None)


def pdl_wins(without_ms: list[float], with_ms: list[float], margin: float = PDL_MARGIN) -> bool:
    """Whether PDL is kept: the profiles' times with it, summed, under `margin` of those without."""
    return sum(with_ms) < margin * sum(without_ms)


def _precompile(engine, feeds_by_profile: list[dict], device: torch.device) -> None:
    """The PDL engine's kernels are other compiles than the ones its layers were timed with (PDL is a
    constexpr and a launch option): compiled in worker processes at once, as the tactics stage's
    are (tactics/compile_pool.py), rather than one by one at its first run. Where that step does
    not apply, they compile at the first run."""
    from ..tactics.compile_pool import precompile

    def collect(recorder) -> None:
        with torch.inference_mode():
            for k, feeds in enumerate(feeds_by_profile):
                recorder.run("pdl", lambda: engine.executor.run(feeds, profile=k))
    precompile(collect, device)


def check_programmatic_launch(graph: Graph, make_header: Callable[[], tuple], device: torch.device,
                              opt_feeds: Callable[[int], dict], log: list,
                              warn: Callable[[str], None] | None = None) -> dict | None:
    """The default (`BuildConfig.pdl` None): the engine with its layers marked for PDL against the
    same engine unmarked, end to end at every profile's opt shapes, replayed as the engine runs
    (engine_timing.fastest_alternating). Leaves the graph marked where PDL wins
    (`pdl_wins`); returns the header's `pdl_check` record, or None where no layer's kernel takes
    part. Where the PDL engine cannot be timed (a kernel that fails to compile or run with it), the
    build goes on without PDL, saying why (`warn`)."""
    if not mark_programmatic_launch(graph):
        return None
    try:
        record = _time_both_ways(graph, make_header, device, opt_feeds)
    except Exception as exc:  # noqa: BLE001 - PDL is an option the build can do without
        clear_programmatic_launch(graph)
        error = untimed_option("pdl", "it", exc, log, warn)
        return {"margin": PDL_MARGIN, "profiles": [], "kept": False, "layers": 0, "error": error}
    kept = pdl_wins([p["without_ms"] for p in record["profiles"]], [p["with_ms"] for p in record["profiles"]])
    record["kept"] = kept
    layers = record["layers"] = mark_programmatic_launch(graph) if kept else 0
    times = "; ".join(f"profile {p['profile']}: {p['without_ms']:.4g} ms without, {p['with_ms']:.4g} ms with"
                      for p in record["profiles"])
    log.append(f"pdl: {layers} layer(s) launched with programmatic dependent launch ({times})" if kept else
               f"pdl: not used, the engine was not {1 - PDL_MARGIN:.0%} faster with it ({times})")
    return record


def _time_both_ways(graph: Graph, make_header: Callable[[], tuple], device: torch.device,
                    opt_feeds: Callable[[int], dict]) -> dict:
    """Both engines' times per profile (the graph comes in marked and leaves unmarked)."""
    from ..runtime.engine import Engine
    marked = Engine(*make_header(), device)
    clear_programmatic_launch(graph)
    plain = Engine(*make_header(), device)
    feeds_by_profile = [opt_feeds(k) for k in range(len(plain.profiles))]
    _precompile(marked, feeds_by_profile, device)
    record = {"margin": PDL_MARGIN, "profiles": []}
    for k, feeds in enumerate(feeds_by_profile):
        times = fastest_alternating({"without": plain.context(k), "with": marked.context(k)}, feeds, device)
        record["profiles"].append({"profile": k, "without_ms": round(times["without"], 5),
                                   "with_ms": round(times["with"], 5)})
    return record
