"""INT8 (FP8) 1×1 stride-1 convolutions as dense GEMMs whose tiles the tensor memory accelerator
loads (tactics "gemm_tma.…").

Over channels-last codes with evenly spaced pixels, a 1×1 stride-1 convolution without padding is
the GEMM [pixels, C] × [C, Cout]: the input is already a row-major matrix. The implicit-GEMM tiles
compute each row's pixel address and padding mask at every K step and load through the threads,
well below a plain Triton INT8 matmul on large-K shapes (docs/decisions/kernel-gemm-tma.md). Here
each K step is two bulk tensor copies: a [BLOCK_M, BLOCK_K] box of
the input and a [BLOCK_N, BLOCK_K] box of the weight, packed K-major (`conv_igemm.pack_weight`).
Rows, columns and K past the matrix are filled with zeros by the copy. Under Triton's interpreter
the descriptors are emulated, so the tests run on the CPU.

The arithmetic is `tile_steps`' (`store_epilogue`): the output equals the emulation's bit for bit,
as the other INT8 tiles' does.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..common.cache_keys import settle_cache_keys
from ..conv.igemm import (GROUP_M, HALVES_MIN_BLOCK_N, PERSISTENT_PROGRAMS_WITHOUT_GPU, TMA_ALIGNMENT, ConvGeometry,
                         TensorDescriptor, as_nchw_view, multiprocessors, packed_weight_descriptor)
from ..pointwise.epilogue import channels_last_output, pixel_stride, triton
from ..common.pdl import launch_options
from ..registry import PACKED_K_MAJOR, Choice, Dims, Flag, LayerFacts, Number, Tactic, register
from ..common.tile_steps import epilogue_arguments, residual_pixels

if triton is not None and TensorDescriptor is not None:
    import triton.language as tl

    from ..common.pdl import await_previous_kernel
    from ..common.tile_steps import (decode_codes_through_mma, store_epilogue, store_epilogue_halves,
                             store_epilogue_halves_given, int8_identity, load_residual_tile, grouped_tile, pixel_coords)

    @triton.jit
    def _gemm_tma_tile(
            tile_id, x_desc, w_desc, bias_ptr, scale_ptr, res_ptr, y_ptr, M, COUT, K, OH, OW, y_row, srn, src, srh,
            srw, res_scale, out_inv_scale, qmin, alpha, beta,
            INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
            RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr, OUT_QUANT: tl.constexpr,
            EPILOGUE_HALVES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            GROUP_M: tl.constexpr, RES_MMA: tl.constexpr):
        """One output tile: its K steps, then the epilogue. RES_MMA: the residual's INT8 codes are
        loaded before the K steps and reach the epilogue through the tensor cores
        (`decode_codes_through_mma`)."""
        pid_m, pid_n = grouped_tile(tile_id, M, COUT, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n_idx, oh, ow = pixel_coords(offs_m, OH, OW)
        if RES_MMA:
            codes = load_residual_tile(res_ptr, pid_n * BLOCK_N, COUT, offs_m < M, n_idx, oh, ow, srn, src, srh, srw,
                                   BLOCK_N)
        if INT8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([pid_m * BLOCK_M, k0])
            b = w_desc.load([pid_n * BLOCK_N, k0])
            if INT8:
                acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)

        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if RES_MMA:
            res_lo, res_hi = decode_codes_through_mma(codes, int8_identity(BLOCK_N), BLOCK_M, BLOCK_N)
            store_epilogue_halves_given(acc, res_lo, res_hi, offs_m, pid_n * BLOCK_N, COUT, offs_m < M, bias_ptr,
                                         scale_ptr, y_ptr, y_row, res_scale, out_inv_scale, qmin, alpha, beta, INT8,
                                         FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT, BLOCK_M, BLOCK_N)
        elif EPILOGUE_HALVES:
            store_epilogue_halves(acc, offs_m, pid_n * BLOCK_N, COUT, offs_m < M, n_idx, oh, ow, bias_ptr, scale_ptr,
                                   res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha,
                                   beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT,
                                   BLOCK_M, BLOCK_N)
        else:
            store_epilogue(acc, offs_m, offs_n, offs_m < M, offs_n < COUT, n_idx, oh, ow, bias_ptr, scale_ptr,
                            res_ptr, y_ptr, y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                            INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT)

    @triton.jit
    def _gemm_tma_kernel(
            x_desc, w_desc, bias_ptr, scale_ptr, res_ptr, y_ptr,
            M, COUT, K, OH, OW, y_row, srn, src, srh, srw,
            res_scale, out_inv_scale, qmin, alpha, beta,
            INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
            RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr, OUT_QUANT: tl.constexpr,
            EPILOGUE_HALVES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            GROUP_M: tl.constexpr, PDL: tl.constexpr = False, PERSISTENT: tl.constexpr = 0,
            RES_MMA: tl.constexpr = False):
        """One tile per program, or with PERSISTENT a program per SM slot walking the tiles in one
        loop that the compiler pipelines as one: flattened (PERSISTENT_FLAT), so that the next tile's
        bulk copies are in flight during this tile's epilogue, or warp-specialized (PERSISTENT_WS),
        a producer warp issuing the copies ahead of the warps that multiply and store."""
        await_previous_kernel(PDL)
        if PERSISTENT == 0:
            _gemm_tma_tile(tl.program_id(0), x_desc, w_desc, bias_ptr, scale_ptr, res_ptr, y_ptr, M, COUT, K, OH, OW,
                           y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta, INT8, FP8,
                           HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT, EPILOGUE_HALVES, BLOCK_M, BLOCK_N,
                           BLOCK_K, GROUP_M, RES_MMA)
        else:
            tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(COUT, BLOCK_N)
            for tile_id in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=PERSISTENT == 1,
                                    warp_specialize=PERSISTENT == 2):
                _gemm_tma_tile(tile_id, x_desc, w_desc, bias_ptr, scale_ptr, res_ptr, y_ptr, M, COUT, K, OH, OW,
                               y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta, INT8, FP8,
                               HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT, EPILOGUE_HALVES, BLOCK_M,
                               BLOCK_N, BLOCK_K, GROUP_M, RES_MMA)


MIN_BLOCK_K = 32  # bytes of 8-bit codes: the tensor cores' K step
# A halved epilogue whose residual of INT8 codes comes through the tensor cores ("residual-mma", as
# resident_gemm.RESIDUAL_PREFETCH's). Each K step here already waits on its bulk copies, and the
# residual's product adds a fifth of the K steps' products: it lost to the plain halved tiles, so
# it is timed from this effort on, where the search is wide anyway (docs/decisions/kernel-gemm-tma.md).
RESIDUAL_MMA_MIN_EFFORT = 4
# How a persistent tile walks its tiles (the kernel's PERSISTENT), by name: "persistent-flat.per-sm2" is
# flattened with two programs per SM, "persistent-ws" warp-specialized with one.
PERSISTENT_FLAT, PERSISTENT_WS = 1, 2
PERSISTENT_WORDS = {0: "", PERSISTENT_FLAT: "persistent-flat", PERSISTENT_WS: "persistent-ws"}


@register
@dataclass(frozen=True)
class GemmTmaTile(Tactic):
    """Rows, columns and K step of a program's tile, warps, pipeline stages; `halves`: the epilogue
    runs over two halves of the columns in turn ("halves"), with half of the float values and
    residual live at once, as conv_igemm's halved tiles. `persistent` (PERSISTENT_FLAT or
    PERSISTENT_WS, 0: one tile per program) launches `programs_per_sm` programs per SM ("per-sm2")
    that walk the tiles between them. `residual_mma` ("residual-mma", halved one-tile tiles only):
    a residual of INT8 codes is loaded before the K steps and added through the tensor cores (see
    resident_gemm's "residual-mma"). Named e.g. "gemm_tma.128x128x128.w8.s3.halves"."""
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    halves: bool = False
    persistent: int = 0
    programs_per_sm: int = 1
    residual_mma: bool = False

    FAMILY: ClassVar[str] = "gemm_tma"
    SCHEME: ClassVar[tuple] = (Dims(("block_m", "block_n", "block_k")), Number("warps", "w"), Number("stages", "s"),
                               Flag("halves", "halves"), Flag("residual_mma", "residual-mma"),
                               Choice("persistent", PERSISTENT_WORDS), Number("programs_per_sm", "per-sm", omit=1))
    WEIGHT_LAYOUT: ClassVar[str] = PACKED_K_MAJOR
    PROGRAMMATIC_LAUNCH: ClassVar[bool] = True

    def invalid(self) -> str | None:
        # Triton blocks are powers of 2; the tensor cores' 8-bit K step is 32 bytes.
        powers = all(v > 0 and v & (v - 1) == 0 for v in (self.block_m, self.block_n, self.block_k))
        if not (powers and self.block_k >= MIN_BLOCK_K and self.warps > 0 and self.stages > 0 and self.block_n >= 2):
            return f"blocks are powers of 2, block_k at least {MIN_BLOCK_K}"
        if self.programs_per_sm < 1 or (self.programs_per_sm > 1 and not self.persistent):
            return "programs per SM are a persistent tile's"
        if self.residual_mma and (self.persistent or not self.halves):
            return "residual-mma is a halved one-tile tile's"
        return None

    def describe(self, layer: LayerFacts) -> str:
        return (f"{layer.codes} triton dense GEMM of a 1x1 layer, tiles by TMA bulk copies {self.fields_text} "
                f"+ fused epilogue")


# Best guesses first: the tiles of the fastest plain INT8 matmul (docs/decisions/kernel-gemm-tma.md)
# have deep K blocks; the builder times as many as its effort allows.
GEMM_TMA_TILES = (GemmTmaTile(128, 128, 128, 8, 3), GemmTmaTile(128, 256, 64, 8, 3), GemmTmaTile(128, 128, 64, 8, 4),
                  GemmTmaTile(256, 128, 64, 8, 3), GemmTmaTile(64, 128, 128, 4, 4), GemmTmaTile(128, 64, 128, 4, 4))
GEMM_TMA_PER_EFFORT = {1: 2, 2: 4, 3: 6}
# Persistent variants, timed from PERSISTENT_MIN_EFFORT on. One-tile programs wait for their copies
# and then for their epilogue (a K of two 128-deep steps, as ResNet-50's layer3 conv3, leaves the
# layer far slower than its product). A persistent program has the next tile's copies in flight
# during this tile's epilogue: flattened for the first FLAT_TILES tiles, warp-specialized for
# WS_TILES, each with 1 and 2 programs per SM. Triton's Hopper warp specialization takes only some
# tiles (bench/kernel_asm.py, sm_90, offline): its 8-warp tiles compile to the plain loop, and the
# 4-warp 128×64 tile fails to compile with Triton 3.8 (3.6 takes it, without its halved epilogue),
# so WS_TILES is the one tile both specialize, and a warp-specialized tile has no halved epilogue.
# Every persistent variant lost to the resident tiles on ResNet-50's expanding 1×1 layers
# (docs/decisions/kernel-gemm-tma.md): timed from effort 4, where the search is wide anyway.
PERSISTENT_MIN_EFFORT = 4
FLAT_TILES = 2
WS_TILES = (GemmTmaTile(64, 128, 128, 4, 4),)
PROGRAMS_PER_SM = (1, 2)


def _matrix_rows(x: torch.Tensor) -> int | None:
    """Elements from one row of the [pixels, C] matrix to the next: a 2-D row-major tensor's row
    stride, a channels-last 4-D tensor's (or channel slice's) pixel stride; None otherwise."""
    if x.dim() == 2:
        return x.stride(0) if x.stride(1) == 1 else None
    if x.dim() != 4 or x.stride(1) != 1:
        return None
    return pixel_stride(x)


def gemm_tma_applies(x: torch.Tensor, w_shape: tuple, geometry: ConvGeometry | None) -> bool:
    """1×1 convolutions of stride 1 without padding (or GEMMs) over 8-bit codes whose rows the bulk
    copy can address: the base and the row stride in 16-byte multiples, and K (bytes of a weight
    row) too."""
    if TensorDescriptor is None or geometry is None or x.element_size() != 1:
        return False
    if tuple(geometry.kernel) != (1, 1) or tuple(geometry.strides) != (1, 1) or any(geometry.pads):
        return False
    row = _matrix_rows(x)
    k = x.shape[1]
    return (row is not None and w_shape[1] == k and k % TMA_ALIGNMENT == 0 and row % TMA_ALIGNMENT == 0
            and x.data_ptr() % TMA_ALIGNMENT == 0 and x.numel() > 0)


def gemm_tma_tactics(x: torch.Tensor, w_shape: tuple, geometry: ConvGeometry | None, effort: int,
                     residual: bool = False, residual_codes: bool = False) -> list[str]:
    """The candidates the builder times at this effort for this layer (none where they do not apply):
    the tiles, fitted to a short K, and their halved-epilogue variants where the epilogue holds
    much at once (with a residual, or in tiles HALVES_MIN_BLOCK_N wide); from
    RESIDUAL_MMA_MIN_EFFORT each of those one tile per program also with its residual through the
    tensor cores where that is INT8 codes (`residual_codes`); from PERSISTENT_MIN_EFFORT the
    persistent variants as well."""
    if not gemm_tma_applies(x, w_shape, geometry):
        return []
    chosen = GEMM_TMA_TILES[:GEMM_TMA_PER_EFFORT.get(effort, len(GEMM_TMA_TILES))]

    def with_halves(tiles: list[GemmTmaTile]) -> list[GemmTmaTile]:
        fitted = list(dict.fromkeys(fit_to_k(tile, w_shape[1]) for tile in tiles))
        return fitted + [replace(tile, halves=True) for tile in fitted
                         if (residual or tile.block_n >= HALVES_MIN_BLOCK_N) and tile.persistent != PERSISTENT_WS]

    tiles = with_halves(list(chosen))
    if residual and residual_codes and effort >= RESIDUAL_MMA_MIN_EFFORT:
        tiles += [replace(tile, residual_mma=True) for tile in tiles if tile.halves]
    if effort >= PERSISTENT_MIN_EFFORT:
        tiles += with_halves([replace(tile, persistent=mode, programs_per_sm=programs) for programs in PROGRAMS_PER_SM
                              for mode, among in ((PERSISTENT_FLAT, chosen[:FLAT_TILES]),
                                                  (PERSISTENT_WS, [t for t in chosen if t in WS_TILES]))
                              for tile in among])
    return [tile.name for tile in tiles]


def fit_to_k(tile: GemmTmaTile, k: int) -> GemmTmaTile:
    """The tile for a layer of K = `k`: its K step no deeper than K needs (ResNet's 1×1 layers over
    64 channels would copy a half-empty 128-deep box), and one pipeline stage where K is one step,
    since a stage's buffers in shared memory then only limit how many programs an SM holds. A
    persistent tile keeps its stages: they hold the next tiles' copies."""
    block_k = min(tile.block_k, max(MIN_BLOCK_K, 1 << (k - 1).bit_length()))
    return replace(tile, block_k=block_k, stages=1 if k <= block_k and not tile.persistent else tile.stages)


def gemm_tma(x: torch.Tensor, w_packed: torch.Tensor, bias: torch.Tensor | None, geometry: ConvGeometry,
             tile: GemmTmaTile, *, dequant_scale: torch.Tensor, residual: torch.Tensor | None = None,
             activation: str | None = None, alpha: float | None = None, beta: float | None = None,
             residual_after_activation: bool = False, input_inv_scale: float | None = None,
             residual_scale: float | None = None, output_inv_scale: float | None = None, qmin: int = -127,
             accumulator_bound: int | None = None, fp8: bool = False, float_dtype: torch.dtype = torch.float32,
             out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """y = epilogue(x · wᵀ) for x 8-bit codes, [N, C, H, W] channels-last (or a channel slice of
    it) or [M, C] row-major, and w_packed [Cout, C, 1, 1] packed K-major by `pack_weight` (or [Cout,
    C]); the epilogue's arguments are conv_igemm's. Output channels-last [N, Cout, H, W] (or [M,
    Cout]), or into `out`."""
    code = torch.float8_e4m3fn if fp8 else torch.int8
    if x.dtype != code or not gemm_tma_applies(x, tuple(w_packed.shape), geometry):
        raise ValueError(f"gemm_tma: input {tuple(x.shape)} {x.dtype} strides {x.stride()} with geometry {geometry} "
                         f"is not {code} codes of a 1×1 stride-1 layer whose rows a bulk copy can address")
    del input_inv_scale  # the input is codes already (checked above)
    if tile.residual_mma and residual is not None and residual.dtype != torch.int8:
        raise ValueError(f"gemm_tma: {tile.name} takes a residual of INT8 codes through the tensor cores, not "
                         f"{residual.dtype}")
    cout, k = w_packed.shape[0], x.shape[1]
    if x.dim() == 4:
        n, _, oh, ow = x.shape
        shape = (n, cout, oh, ow)
        m = n * oh * ow
    else:
        oh = ow = 1
        m = x.shape[0]
        shape = (m, cout)
    y = channels_last_output(shape, code if output_inv_scale is not None else float_dtype, x.device, out,
                             "gemm_tma")
    x_desc = TensorDescriptor(x, [m, k], [_matrix_rows(x), 1], [tile.block_m, tile.block_k])
    w_desc = packed_weight_descriptor(w_packed, tile.block_n, tile.block_k)
    rs = as_nchw_view(residual).stride() if residual is not None else (0, 0, 0, 0)
    (oh, ow), rs = residual_pixels(rs, shape[0], (oh, ow))
    scalars, flags = epilogue_arguments(
        quantized=True, fp8=fp8, bias=bias, residual=residual, activation=activation, alpha=alpha, beta=beta,
        residual_after_activation=residual_after_activation, residual_scale=residual_scale,
        output_inv_scale=output_inv_scale, qmin=qmin,
        accumulator_bound=accumulator_bound)
    programs = triton.cdiv(m, tile.block_m) * triton.cdiv(cout, tile.block_n)  # one per tile
    if tile.persistent:
        programs = min(programs, tile.programs_per_sm * (multiprocessors(x.device) or PERSISTENT_PROGRAMS_WITHOUT_GPU))
    grid = (programs,)
    _gemm_tma_kernel[grid](x_desc, w_desc, bias if bias is not None else w_packed, dequant_scale,
                           residual if residual is not None else y, y, m, cout, k, oh, ow, pixel_stride(y),
                           *rs, *scalars, **flags, EPILOGUE_HALVES=tile.halves, BLOCK_M=tile.block_m,
                           BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                           GROUP_M=GROUP_M, PDL=pdl, PERSISTENT=tile.persistent,
                           RES_MMA=tile.residual_mma and residual is not None, **launch_options(pdl),
                           num_warps=tile.warps,
                           num_stages=tile.stages,
                           enable_fp_fusion=False)  # round as the emulation does (see conv_igemm)
    return y


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
