"""The executor runs each layer at its own launch site and a context binds its own arrival counters
while it runs (kernels/common/arrival_counters.py): so the split-K layers that end in the kernel
of two contexts, or of two branches of one, never count in at the same words."""
from __future__ import annotations

import torch

from sartor.kernels.common.arrival_counters import bound_counters, current_launch_site


def test_each_layer_runs_at_its_own_site_with_its_contexts_counters(tiny_engine, images, monkeypatch):
    seen = {}
    for index, step in enumerate(tiny_engine.executor.steps):
        def recording(inputs, attrs, impl=step.impl, index=index):
            seen[index] = (current_launch_site(), bound_counters())
            return impl(inputs, attrs)
        monkeypatch.setattr(step, "impl", recording)
    first, second = tiny_engine.context(), tiny_engine.context()
    assert first.arrival_counters is not second.arrival_counters
    for context in (first, second):
        seen.clear()
        context.run({"images": images})
        device_steps = [i for i, step in enumerate(tiny_engine.executor.steps) if not step.on_host]
        assert sorted(seen) == device_steps
        assert all(site == index and counters is context.arrival_counters for index, (site, counters) in seen.items())
    assert current_launch_site() is None and bound_counters() is None
    seen.clear()
    tiny_engine.executor.run({"images": torch.from_numpy(images)})  # outside a context: none bound
    assert seen and all(counters is None for _, counters in seen.values())
