"""builder/engine_timing.py: whole engines timed in turn, each's fastest round kept."""
from __future__ import annotations

import torch

from sartor.builder import engine_timing


def test_engines_are_timed_in_turn_for_the_device_s_rounds_and_each_keeps_its_fastest(monkeypatch):
    calls = []

    def timed(context, feeds, device):
        calls.append(context)
        return next(clock)
    monkeypatch.setattr(engine_timing, "time_context", timed)
    for device, rounds in ((torch.device("cuda"), 5), (torch.device("cpu"), 2)):
        calls.clear()
        clock = iter([1.0, 2.0, 0.8, 2.5, 0.9, 1.5, 1.1, 1.9, 1.2, 1.7])
        times = engine_timing.fastest_alternating({"plain": "a", "variant": "b"}, {}, device)
        assert calls == ["a", "b"] * rounds == ["a", "b"] * engine_timing.ROUNDS[device.type]
        assert times == ({"plain": 0.8, "variant": 1.5} if rounds == 5 else {"plain": 0.8, "variant": 2.0})
