"""DeviceCopies: a batch's device-to-device output copies, queued by the requests' sinks and issued
together (one multi-tensor copy per device and dtype). CPU tensors stand in for CUDA ones."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tritonclient")  # sartor.serve's protocol types (the routine carries .whl/serve)

from sartor.serve import device_copies  # noqa: E402
from sartor.serve.device_copies import DeviceCopies, wait_for_tensors  # noqa: E402


def test_queued_copies_happen_at_run_not_before_and_only_once():
    targets = [torch.zeros(4, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8), torch.zeros(3)]
    sources = [torch.arange(4, dtype=torch.uint8), torch.tensor([7, 9], dtype=torch.uint8), torch.ones(3)]
    copies = DeviceCopies()
    for target, source in zip(targets, sources):
        copies.add(target, source)
    assert len(copies) == 3
    assert all(not target.any() for target in targets)  # queued, not copied
    copies.run()  # two dtypes: two groups
    for target, source in zip(targets, sources):
        assert torch.equal(target, source)
    assert len(copies) == 0
    sources[0].fill_(5)
    copies.run()  # nothing left to issue
    assert torch.equal(targets[0], torch.arange(4, dtype=torch.uint8))


def test_a_mismatched_pair_is_refused_when_queued():
    copies = DeviceCopies()
    with pytest.raises(ValueError, match=r"device copy: target torch.uint8 \(4,\) on cpu, source torch.uint8 \(3,\)"):
        copies.add(torch.zeros(4, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="source torch.float32"):
        copies.add(torch.zeros(4, dtype=torch.uint8), torch.zeros(4))
    assert len(copies) == 0
    copies.run()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_run_returns_once_the_device_is_done():
    """The wait (asleep, on an event) covers the batch's work queued before the copies."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # tens of milliseconds of queued work: not done when the copies are issued
        x = torch.tanh(x @ x)
    target = torch.empty(4096, device="cuda")
    copies = DeviceCopies()
    copies.add(target, x[0])
    copies.run()
    assert torch.cuda.current_stream().query()
    assert torch.equal(target, x[0])


def test_tensors_off_the_gpu_need_no_wait(monkeypatch):
    monkeypatch.setattr(device_copies, "wait_asleep", lambda stream: pytest.fail("waited for a CPU tensor"))
    wait_for_tensors([torch.zeros(2), torch.ones(3, dtype=torch.int8)])
    wait_for_tensors([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_wait_for_tensors_returns_once_their_device_is_done():
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        x = torch.tanh(x @ x)
    wait_for_tensors([x, torch.zeros(1)])
    assert torch.cuda.current_stream().query()
