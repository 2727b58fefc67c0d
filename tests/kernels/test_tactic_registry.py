"""The tactic registry (`sartor/kernels/registry.py`): one naming scheme for every kernel family,
each family registered once by its own module, the words `inspect` shows taken from the family,
and engines or timing caches naming tactics in the scheme before it refused in one line."""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import sartor
from sartor.builder.pipeline import _tactic
from sartor.errors import EngineFileError, SartorError
from sartor.ir import Node
from sartor.kernels import registry
from sartor.kernels.conv.igemm import TileConfig, candidate_tiles, halved_epilogue_tiles, padded_tap_tiles
from sartor.kernels.conv.tma import TMA_TILES, TmaTile
from sartor.kernels.gemm.tma import GEMM_TMA_TILES, WS_TILES, GemmTmaTile
from sartor.kernels.pool.max_pool import POOL_TILES, PoolTile, pool_tactics
from sartor.kernels.registry import (FAMILY_MODULES, LayerFacts, Number, Tactic, TacticNameError, families,
                                     parse_tactic, register, tactic_for)
from sartor.kernels.gemm.resident import ResidentTile, resident_tactics
from sartor.kernels.window.resident import POOLED_TILES
from sartor.ops.conv import conv_weight_for_tactic
from sartor.ops.quantized import SPLIT_TACTIC, Im2colIgemm, qconv, qlayer_weight_for_tactic
from sartor.ops.quantized_window import window_tactics
from sartor.runtime.engine_file import FORMAT_VERSION, MAGIC
from tests.conftest import assert_cli_error


def _every_offered_name() -> list[str]:
    """The names the builder's candidate lists can hold, at every effort, and the fixed tactics."""
    names = [name for family in families().values() if not family.SCHEME for name in [family.FAMILY]]
    for effort in range(6):
        tiles = candidate_tiles(True, effort) + candidate_tiles(False, effort)
        tiles += halved_epilogue_tiles(tiles, residual=True) + padded_tap_tiles(tiles, 24, 24, eight_bit=True)
        names += [tile.name for tile in tiles] + [Im2colIgemm(tile).name for tile in tiles]
        names += resident_tactics(effort, residual=True, k_total=512, residual_codes=True)
        names += window_tactics(effort, space_to_depth=True, max_pool=True) + pool_tactics(effort, 1, 132)
    names += [tile.name for tile in (*TMA_TILES, *GEMM_TMA_TILES, *WS_TILES, *POOL_TILES)] + [SPLIT_TACTIC]
    return names


def test_every_offered_tactic_name_round_trips_through_the_registry():
    names = _every_offered_name()
    assert len(set(names)) > 200
    for name in names:
        tactic = parse_tactic(name)
        assert tactic.name == name and parse_tactic(tactic.name) == tactic, name


def test_names_are_dot_separated_fields_with_named_flags():
    assert TileConfig(128, 128, 64, 8, 3, split_k=4).name == "igemm.128x128x64.w8.s3.split4"
    assert ResidentTile(64, 64, 8, 4, 2, residual_prefetch=3, n_adjacent=True, columns_loaded=True).name == \
        "resident.64x64.t8.w4.s2.residual-mma.cols-loaded.grouped"
    assert TmaTile(8, 16, 64, 64, 4, 4, persistent=3).name == "tma.8x16x64x64.w4.s4.persistent3"
    assert GemmTmaTile(128, 128, 64, 8, 3, halves=True, persistent=1, programs_per_sm=2).name == \
        "gemm_tma.128x128x64.w8.s3.halves.persistent-flat.per-sm2"
    assert POOLED_TILES[1].resident.name == "resident.64x64.t8.w4.s2"
    assert window_tactics(1, max_pool=True)[-1] == "window_resident.64x64.t4.w4.s2.kh-steps.row-pairs.max-pool"
    assert POOL_TILES[0].name == "max_pool.elements4096.channels64.w4"


def test_each_family_registers_once_under_its_own_word():
    known = families()
    assert all(cls.FAMILY == word for word, cls in known.items())
    assert len({cls for cls in known.values()}) == len(known)
    assert {"igemm", "resident", "tma", "gemm_tma", "max_pool", "im2col_igemm", "window_igemm", "window_resident",
            "resident_split_projection", "torch"} <= set(known)
    register(PoolTile)  # the same class again: a no-op, as a module imported twice registers it again

    @dataclass(frozen=True)
    class Impostor(Tactic):
        FAMILY: ClassVar[str] = "max_pool"
    with pytest.raises(ValueError, match="registered twice"):
        register(Impostor)
    assert families()["max_pool"] is PoolTile
    assert len(FAMILY_MODULES) == len(set(FAMILY_MODULES))


def test_a_new_family_is_one_module_and_one_registration(monkeypatch):
    """A family declares its fields; its name, parser and words need nothing else of sartor."""
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))

    @register
    @dataclass(frozen=True)
    class Blur(Tactic):
        taps: int
        warps: int = 4
        FAMILY: ClassVar[str] = "blur"
        SCHEME: ClassVar[tuple] = (Number("taps", "taps"), Number("warps", "w", omit=4))

        def describe(self, layer: LayerFacts) -> str:
            return f"triton blur of {self.taps} taps ({layer.op_type})"

    assert Blur(5).name == "blur.taps5" and parse_tactic("blur.taps5.w8") == Blur(5, 8)
    described = _tactic(Node("Blur", "b", ["x"], ["y"], {"tactic": "blur.taps5"}), torch.device("cpu"))
    assert described == "triton blur of 5 taps (Blur)"
    with pytest.raises(TacticNameError):
        parse_tactic("blur.taps5.w4")  # one spelling: the default warps are left out


@pytest.mark.parametrize("name, op_type", [
    ("igemm.128x128x64.w8.s3.halves.residual-early", "QConv"), ("resident.64x64.t8.w4.s3.grouped", "QConv"),
    ("tma.8x16x64x64.w4.s4", "QConv"), ("gemm_tma.128x128x128.w8.s3.halves", "QGemm"),
    ("window_resident.64x64.t8.w4.s2.kh-steps.row-pairs.space-to-depth", "QConv"),
    ("im2col_igemm.64x64x32.w4.s4", "QConv"), (SPLIT_TACTIC, "QConv"),
    ("max_pool.elements4096.channels64.w4", "MaxPool"),
    ("cudnn_fused", "FusedConv"), ("cublas_int_mm", "QConv"), ("torch", "QConv"), (None, "Relu")])
def test_inspect_words_are_the_familys_description(name, op_type):
    node = Node(op_type, "layer", ["x"], ["y"], {} if name is None else {"tactic": name})
    words = _tactic(node, torch.device("cuda"))
    assert words == tactic_for(name).describe(LayerFacts(op_type, device_type="cuda"))
    tactic = tactic_for(name)
    if tactic.SCHEME and not isinstance(tactic, PoolTile):  # the tile's fields, as the name spells them
        assert (tactic.tile if hasattr(tactic, "tile") else tactic).fields_text in words


@pytest.mark.parametrize("name, fragment", [
    ("igemm_128x128x64_w8_s3", "unknown tactic 'igemm_128x128x64_w8_s3'"),
    ("resident_64x64_t8_w4_s3_c_g", "unknown tactic"),
    ("window_s2d_resident_64x64_t8_w4_s2_kh", "unknown tactic"),
    ("igemm.128x128x64.w8", "is not a igemm tactic"),
    ("resident.64x64.t8.w4.s3.g", "is not a resident tactic"),
    ("", "unknown tactic ''")])
def test_unknown_or_old_tactic_names_are_refused_clearly(name, fragment):
    with pytest.raises(TacticNameError) as info:
        parse_tactic(name)
    assert isinstance(info.value, SartorError) and fragment in str(info.value) and "\n" not in str(info.value)


def test_running_or_laying_out_a_layer_for_an_unknown_tactic_raises():
    wq = torch.zeros(8, 4, 1, 1, dtype=torch.int8)
    with pytest.raises(TacticNameError, match="rebuild"):
        qlayer_weight_for_tactic(wq, "igemm_64x64x64_w4_s4")
    with pytest.raises(TacticNameError):
        conv_weight_for_tactic(torch.zeros(8, 4, 3, 3), "resident_64x64_t8_w4_s3")
    attrs = {"input_inv_scale": 1.0, "tactic": "tma_8x16x64x64_w4_s4"}
    with pytest.raises(TacticNameError):
        qconv([torch.zeros(1, 4, 2, 2), wq, None, None, torch.ones(8)], attrs)


def test_weight_layouts_come_from_the_family():
    w = torch.randint(-5, 5, (8, 4, 3, 3), dtype=torch.int8)
    assert torch.equal(qlayer_weight_for_tactic(w, "torch"), w)
    packed = qlayer_weight_for_tactic(w, "igemm.64x64x32.w4.s4")
    assert packed.is_contiguous(memory_format=torch.channels_last) and torch.equal(packed, w)
    assert qlayer_weight_for_tactic(w, "im2col_igemm.64x64x32.w4.s4").shape == (8, 64)  # 36 padded to 64
    assert qlayer_weight_for_tactic(w[:, :3], "window_igemm.64x64x32.w4.s4").shape == (8, 32, 3, 1)


def _version_one(data: bytes) -> bytes:
    body = bytearray(data[:-32])
    struct.pack_into("<I", body, len(MAGIC), 1)
    body = bytes(body)
    return body + hashlib.sha256(body).digest()


def test_an_engine_of_the_old_scheme_is_refused_in_one_line(tiny_plan, tmp_path, cli):
    assert FORMAT_VERSION == 2
    old = tmp_path / "old.plan"
    old.write_bytes(_version_one(tiny_plan.read_bytes()))
    with pytest.raises(EngineFileError, match="before the tactic registry"):
        sartor.load(old, device="cpu")
    for argv in (["inspect", old], ["run", old]):
        assert_cli_error(cli(*argv), "format version 1", "tactic registry", "rebuild the engine")
