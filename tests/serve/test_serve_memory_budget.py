"""Several models on one device: `serve --memory-budget` and a model's own memory_budget parameter
refuse, with the numbers, a version that would not fit, while the others serve; the instance_group
count (the concurrent contexts) multiplies each context's memory. CPU engines: the accounting is the
same (weights, arena, inputs)."""
from __future__ import annotations

import json

import pytest
from serve_helpers import add_model, http_client, http_infer, images, running

import sartor
from sartor.errors import ConfigError
from sartor.serve.memory_budget import parse_size

BUDGET_PARAMETER = 'parameters { key: "memory_budget" value: { string_value: "%s" } }\n'


@pytest.fixture
def need(tiny_plan) -> tuple[int, int]:
    """(the tiny engine's weights, one context's bytes) as the server will count them."""
    engine = sartor.load(tiny_plan, device="cpu")
    return engine.weight_bytes + engine.profile_weight_bytes, engine.context_memory_bytes


def test_engine_memory_is_weights_plus_each_context_at_the_largest_profile(tiny_plan, need):
    engine = sartor.load(tiny_plan, device="cpu")
    (row,) = engine.memory_by_profile
    assert row["input_bytes"] == 4 * 3 * 16 * 16 * 4  # images at the max shape, float32
    assert row["arena_bytes"] == engine.header["memory"]["profiles"][0]["arena_bytes"] > 0
    assert row["context_bytes"] == row["arena_bytes"] + row["input_bytes"] + row["workspace_bytes"]
    assert engine.device_memory_bytes == sum(need) == row["total_bytes"]
    assert engine.device_memory_for(3) == need[0] + 3 * need[1]


def test_inspect_reports_memory_per_profile(tiny_plan, cli, need):
    info = json.loads(cli("inspect", tiny_plan, "--json").out)
    (row,) = info["memory"]["by_profile"]
    assert row["total_bytes"] == info["memory"]["device_bytes"] == sum(need)
    text = " ".join(cli("inspect", tiny_plan).out.split())
    assert "profile 0 at max shapes" in text and "inputs 12.00 KiB" in text and "per context" in text


def test_a_model_over_the_budget_is_refused_while_the_other_serves(tmp_path, tiny_plan, need):
    root = tmp_path / "repo"
    add_model(root, "first", tiny_plan)
    add_model(root, "second", tiny_plan)
    budget = sum(need) + need[1] // 2  # one model and half a context more
    with running(root, memory_budget=budget) as server:
        index = {row["name"]: row for row in server.index()}
        assert index["first"]["state"] == "READY"
        second = index["second"]
        assert second["state"] == "UNAVAILABLE"
        assert f"model 'second' version 1 needs {_size(sum(need))} on cpu" in second["reason"]
        assert "1 context x" in second["reason"] and "profile 0 at max shapes" in second["reason"]
        assert f"--memory-budget {_size(budget)} has" in second["reason"] and "held: first" in second["reason"]
        client = http_client(server)
        assert http_infer(client, images(1, 0), model="first").as_numpy("logits").shape == (1, 10)
        assert not client.is_model_ready("second")
        # Unloading the first gives its memory back: the second then fits.
        client.unload_model("first")
        client.load_model("second")
        assert client.is_model_ready("second")
        assert server.repository.memory.held("first") == {}
        assert server.repository.memory.held("second") == {"cpu": sum(need)}
        client.close()


def test_each_instance_is_a_context_the_budget_counts(tmp_path, tiny_plan, need):
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan, "instance_group [{ count: 3 }]\n")
    with running(root, memory_budget=need[0] + 2 * need[1]) as server:
        (row,) = server.index()
        assert row["state"] == "UNAVAILABLE" and "3 contexts x" in row["reason"]
    with running(root, memory_budget=need[0] + 3 * need[1]) as server:
        assert server.index()[0]["state"] == "READY"


def test_a_models_own_memory_budget(tmp_path, tiny_plan, need):
    root = tmp_path / "repo"
    add_model(root, "small", tiny_plan, BUDGET_PARAMETER % (sum(need) - 1))
    add_model(root, "roomy", tiny_plan, BUDGET_PARAMETER % "1M")
    add_model(root, "typo", tiny_plan, BUDGET_PARAMETER % "lots")
    with running(root) as server:
        index = {row["name"]: row for row in server.index()}
    assert index["roomy"]["state"] == "READY"
    assert index["small"]["state"] == "UNAVAILABLE"
    assert f"its config's memory_budget is {_size(sum(need) - 1)}" in index["small"]["reason"]
    assert index["typo"]["state"] == "UNAVAILABLE"
    assert "parameter memory_budget 'lots' is not a size: write it as 8G, 512M" in index["typo"]["reason"]


def test_sizes():
    assert parse_size("8G", "x") == 8 << 30 and parse_size("512MiB", "x") == 512 << 20
    assert parse_size("1.5g", "x") == 3 << 29 and parse_size("4096", "x") == 4096
    for bad in ("8X", "", "-1G", "0"):
        with pytest.raises(ConfigError):
            parse_size(bad, "--memory-budget")


def test_cli_memory_budget(cli, tmp_path, tiny_plan):
    root = tmp_path / "repo"
    add_model(root, "tiny", tiny_plan)
    result = cli("serve", "--model-repository", root, "--memory-budget", "8X")
    message = "error: --memory-budget '8X' is not a size: write it as 8G, 512M or a number of bytes"
    assert result.code == 2 and result.error_lines == [message]
    result = cli("serve", "--model-repository", root, "--dry-run", "--memory-budget", "1K")
    assert result.code == 1 and "UNAVAILABLE" in result.out and "--memory-budget" in " ".join(result.out.split())
    result = cli("serve", "--model-repository", root, "--dry-run", "--memory-budget", "1G")
    assert result.code == 0 and "READY" in result.out


def _size(n: int) -> str:
    from sartor.serve.memory_budget import fmt_size
    return fmt_size(n)
