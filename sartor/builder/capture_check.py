"""The build's trial capture (CUDA builds): the engine run once per profile at its opt shapes
through an ExecutionContext with CUDA graphs, so that a layer whose capture fails is found at
build time, recorded in the header (`capture`) and run eagerly from the first load, and the build
log and `sartor inspect` say which layers run outside the graph and why."""
from __future__ import annotations

from typing import Callable

import torch

from ..runtime.capture import describe_eager_layers, first_line
from ..runtime.engine import Engine


def check_capture(header: dict, tensors: dict, device: torch.device, opt_feeds: Callable[[int], dict],
                  log: list, warn: Callable[[str], None]) -> dict:
    """The header's `capture` record: the layers that run outside the CUDA graph, with their reasons."""
    engine = Engine(header, tensors, device)
    try:
        for k in range(len(engine.profiles)):
            engine.context(k).run(opt_feeds(k))
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - the engine is still written; the load will capture as it can
        line = f"capture: not checked ({first_line(exc)})"
        log.append(line)
        warn(line)
        return {"checked": False, "eager_layers": [layer.to_json() for layer in engine.eager_layers]}
    records = [layer.to_json() for layer in engine.eager_layers]
    device_layers = sum(not step.on_host for step in engine.executor.steps)
    if not records:
        log.append(f"capture: every run is one CUDA graph ({device_layers} device layers)")
    else:
        line = (f"capture: {len(records)} of {device_layers} device layers run outside the CUDA graph, between "
                f"captured pieces: {describe_eager_layers(records)}")
        log.append(line)
        warn(line)
    return {"checked": True, "eager_layers": records}
