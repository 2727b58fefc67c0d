"""bench/serve_throughput.py's repository for several GPUs (issue 36): `--device cuda:0,cuda:1` puts
--instances instances on each GPU, as Triton's instance_group gpus, which the server reads so."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import serve_throughput  # noqa: E402
from sartor.serve.config import _instances, read_config  # noqa: E402


def test_instances_go_on_every_gpu_named(tmp_path):
    plan = tmp_path / "yolo.v8n.plan"
    plan.write_bytes(b"an engine")
    models = serve_throughput.make_repository(plan, tmp_path / "repo", 32, 500, 2, "cuda:0,cuda:1", ("batched",))
    assert models == ["yolo_v8n_batched"]
    config, _ = read_config(tmp_path / "repo" / models[0])
    assert _instances(config, ["cuda:0", "cuda:1"], "cuda", models[0]) == [("cuda:0", 2), ("cuda:1", 2)]
    one = serve_throughput.make_repository(plan, tmp_path / "one", 32, 500, 1, "cuda:1", ("single",))
    config, _ = read_config(tmp_path / "one" / one[0])
    assert _instances(config, ["cuda:1"], "cuda", one[0]) == [("cuda:1", 1)]
    cpu = serve_throughput.make_repository(plan, tmp_path / "cpu", 32, 500, 1, "cpu", ("single",))
    assert "gpus" not in (tmp_path / "cpu" / cpu[0] / "config.pbtxt").read_text()
