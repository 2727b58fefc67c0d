"""The steps every tensor-core kernel of sartor shares (implicit GEMM, TMA, resident, windows, the
library GEMMs' epilogue), in Triton: the product of a tile with its A operand quantized on load
(`accumulate_dot`), the rounding of float values to INT8 codes and E4M3, and the fused epilogue that
dequantizes a tile, adds its residual, applies its activation, requantizes and stores it
(`store_epilogue` and its variants in column halves, with the residual or the columns' bias and
scale loaded beforehand). `epilogue_arguments` gives a kernel the epilogue's runtime scalars and
constexpr flags. The arithmetic is the one `sartor/ops/quantized.py` documents, step for step, so
that every kernel's output equals the emulation's.
"""
from __future__ import annotations

import torch

from ..pointwise.epilogue import ACTIVATION_CODES, triton
from .cache_keys import settle_cache_keys

# How an INT8 kernel's epilogue turns its int32 sums (with the bias) into float32: the value of its
# INT8 constexpr (False: the layer is not INT8). SUMS_CONVERTED: by a conversion instruction, which
# Hopper issues at 16 a clock per SM, an eighth of a float add's rate, one per output value.
# SUMS_DECODED: the sum plus 0x4B400000 (the bits of 1.5·2^23) is, as bits, the float 1.5·2^23 + sum
# exactly while |sum| < DECODABLE_SUM, so one float subtraction decodes it; a layer's kernels take it
# only where its weights bound every sum below that (`passes/bound_accumulators.py`).
SUMS_CONVERTED, SUMS_DECODED = 1, 2
DECODABLE_SUM = 2 ** 22
# OUT_QUANT of an epilogue: float output (0), INT8 (FP8) codes clamped to [qmin, 127] (CODES), or
# codes whose lower clamp cannot bind (CODES_ABOVE_FLOOR: `output_codes`), which the epilogue drops.
CODES = 1
CODES_ABOVE_FLOOR = 2

if triton is not None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from ..pointwise.epilogue import activate

    @triton.jit
    def odometer_step(low, middle, high, low_count, middle_count):
        """(low, middle, high) one step on as the digits of a mixed-radix counter: low counts to
        low_count, then middle to middle_count, then high. Carried from step to step, where dividing
        them out of the step's number cost runtime divisions per step (bench/kernel_asm.py --loop-mix)."""
        low += 1
        low_done = low == low_count
        low = tl.where(low_done, 0, low)
        middle = tl.where(low_done, middle + 1, middle)
        middle_done = middle == middle_count
        middle = tl.where(middle_done, 0, middle)
        high = tl.where(middle_done, high + 1, high)
        return low, middle, high

    @triton.jit
    def next_k_step(kh, kw, cb, c_blocks, KW: tl.constexpr):
        """A convolution's K walk, one step on from filter tap (kh, kw) and channel block cb: the
        next channel block, else the tap to the right, else the first of the next filter row."""
        cb, kw, kh = odometer_step(cb, kw, kh, c_blocks, KW)
        return kh, kw, cb

    @triton.jit
    def pixel_coords(offsets, OH, OW):
        """Flat output-pixel indices of an NHWC tensor → (n, oh, ow)."""
        pixels = OH * OW
        if offsets.dtype == tl.int32:
            # Unsigned: the indices are never negative, and an unsigned division is shorter (no
            # signs to take off and put back).
            # (tl.cast: OH or OW may be a Python int, a launch argument of 1 specialized away.)
            n = (offsets.to(tl.uint32) // tl.cast(pixels, tl.uint32)).to(tl.int32)
            rem = offsets - n * pixels
            oh = (rem.to(tl.uint32) // tl.cast(OW, tl.uint32)).to(tl.int32)
        else:
            n = offsets // pixels
            rem = offsets - n * pixels
            oh = rem // OW
        return n, oh, rem - oh * OW

    @triton.jit
    def pixel_channel_tile(P, C, OH, OW, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """A program's block of output pixels (grid axis 0) and channels (axis 1) of a channels-last
        tensor: their offsets, their masks and each pixel's (n, oh, ow)."""
        offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        p_ok = offs_p < P
        c_ok = offs_c < C
        n, oh, ow = pixel_coords(offs_p, OH, OW)
        return offs_p, offs_c, p_ok, c_ok, n, oh, ow

    @triton.jit
    def window_origin(n, oh, ow, sxn, SH, SW, pad_h, pad_w):
        """Each output pixel's input image offset (sxn: the image stride) and its window's first input
        row and column, negative in the padding."""
        return n.to(tl.int64) * sxn, oh * SH - pad_h, ow * SW - pad_w

    @triton.jit
    def tap_pixels(base, ih, iw, p_ok, H, W, sxh, sxw):
        """A tap's input pixel offsets for the program's output pixels, and which lie inside the
        image (padding is left out by the mask)."""
        return base + ih * sxh + iw * sxw, p_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)

    @triton.jit
    def grouped_tile(pid, M, COUT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                     ONE_COLUMN: tl.constexpr = False):
        """(row tile, column tile) of program `pid` in grouped order: GROUP_M row tiles walk the
        column tiles together, so that neighbouring programs share weight columns in L2. ONE_COLUMN:
        the layer's outputs fit one column tile, so (pid, 0), without the order's four runtime
        divisions."""
        if ONE_COLUMN:
            return pid, 0
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(COUT, BLOCK_N)
        group_size = GROUP_M * num_pid_n
        first_m = (pid // group_size) * GROUP_M
        rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (pid % group_size) % rows, (pid % group_size) // rows

    @triton.jit
    def _round_half_even(v):
        # floor + exact fraction: v - floor(v) is exact in float32, unlike floor(v + 0.5).
        r = tl.floor(v)
        f = v - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        up = (f > 0.5) | ((f == 0.5) & odd)
        return tl.where(up, r + 1.0, r)

    @triton.jit
    def quantize_int8(v, inv_scale, qmin):
        """The INT8 code of v: round(v · inv_scale) half to even, clamped to [qmin, 127].
        One float32 add of 1.5·2^23 rounds: for |v · inv_scale| < 2^22 the sum lies in
        [2^23, 2^24), where float32 steps are 1, so the add rounds to the nearest integer, ties to
        even (1.5·2^23 is even), as the emulation's code does. Beyond, the sum lies outside the
        clamp bounds, which are integers of that range, so the clamp gives the saturated code. The
        clamped sum is 0x4B400000 + code as bits, and 0x4B400000's low byte is 0: the code is its
        low byte. No float → integer conversion: Hopper converts 16 values per clock per SM, an
        eighth of a float add's rate (bench/kernel_asm.py counts them), and a packing kernel needs
        one per element. An epilogue's output rounds the exact product (requantize_int8)."""
        t = v * inv_scale + 12582912.0
        t = tl.minimum(tl.maximum(t, 12582912.0 + qmin), 12583039.0)
        return t.to(tl.int32, bitcast=True).to(tl.int8)

    @triton.jit
    def _scalar_float64(scale):
        """A float32 kernel argument widened to float64: the interpreter passes such an argument as
        a Python float, which it would otherwise use unrounded."""
        return tl.cast(scale, tl.float32).to(tl.float64)

    @triton.jit
    def _fma_round_to_odd(a, b, c):
        """a·b + c rounded once to float32, without an fma instruction (Triton's interpreter computes
        tl.fma as a product and a sum, each rounded): the product of two float32 values is exact in
        float64; the float64 sum is made round-to-odd from its error (TwoSum), and rounding that to
        float32 rounds as the exact value would (Boldo and Melquiond, 2008). ops/quantized.py's
        `fused_multiply_add` does the same in torch."""
        p = a.to(tl.float64) * _scalar_float64(b)
        c64 = c.to(tl.float64)
        s = p + c64
        back = s - p
        error = (p - (s - back)) + (c64 - back)
        bits = s.to(tl.int64, bitcast=True)
        toward_exact = tl.where((error > 0) == (s > 0), 1, -1).to(tl.int64)
        inexact_even = (error != 0) & ((bits & 1) == 0) & (s - s == 0)  # finite s only
        return tl.where(inexact_even, bits + toward_exact, bits).to(tl.float64, bitcast=True).to(tl.float32)

    @triton.jit
    def requantize_int8(v, inv_scale, qmin):
        """The INT8 code of an epilogue's output: round(v · inv_scale) half to even, of the exact
        product, clamped to [qmin, 127]. On the GPU one fused multiply-add with 1.5·2^23 rounds
        once (as quantize_int8's add does) where a multiply and an add took two instructions and
        two roundings; the emulation (ops/quantized.py `requantize`) rounds the exact float64
        product. Interpreted, the product is exact in float64 and rounded there."""
        if COMPILED:
            t = tl.fma(v, inv_scale, 12582912.0)
            t = tl.minimum(tl.maximum(t, 12582912.0 + qmin), 12583039.0)
            return t.to(tl.int32, bitcast=True).to(tl.int8)
        q = _round_half_even(v.to(tl.float64) * _scalar_float64(inv_scale))
        return tl.minimum(tl.maximum(q, qmin), 127.0).to(tl.int8)

    @triton.jit
    def _requantize_code_above_floor(v, inv_scale):
        """requantize_int8 of a v whose code cannot fall below qmin (ReLU's output; SiLU's at a
        coarse enough scale: `output_codes`): the rounded sum is at least 1.5·2^23 + qmin, so the lower
        clamp, one instruction an output value, has nothing to do."""
        if COMPILED:
            t = tl.minimum(tl.fma(v, inv_scale, 12582912.0), 12583039.0)
            return t.to(tl.int32, bitcast=True).to(tl.int8)
        return tl.minimum(_round_half_even(v.to(tl.float64) * _scalar_float64(inv_scale)), 127.0).to(tl.int8)

    @triton.jit
    def _add_scaled_residual(y, residual, res_scale):
        """y + residual · res_scale rounded once (a fused multiply-add): the residual's codes
        (already float32, exactly) times their scale, added to the layer's value."""
        if COMPILED:
            return tl.fma(residual, res_scale, y)
        return _fma_round_to_odd(residual, res_scale, y)

    @triton.jit
    def quantize_operand(v, inv_scale, qmin):
        """quantize_int8 for the A tile of a float-input layer, which goes on into tl.dot: there
        the code is converted from the float value. On the GPU (Triton 3.6) a product over
        quantize_int8's low bytes read wrong codes (every code came out -1; the builder's output
        check rejected those tactics), while the same codes stored by an epilogue or a packing
        kernel were right (docs/decisions/kernel-tile-steps-rounding.md)."""
        return float_codes(v, inv_scale, qmin).to(tl.int8)

    @triton.jit
    def float_codes(v, inv_scale, qmin):
        """quantize_operand's codes left as float32 values (exact integers): for sums kept in float32,
        with no float → int conversion."""
        q = (v * inv_scale + 12582912.0) - 12582912.0
        return tl.minimum(tl.maximum(q, qmin), 127.0)

    # 0x4B400000 is the bits of the float 1.5·2^23, whose float32 neighbours are 1 apart: an int32 i
    # with |i| < 2^22 added to it gives, as bits, the float 1.5·2^23 + i exactly.
    _OFFSET_BITS = tl.constexpr(0x4B400000)

    @triton.jit
    def _decode_offset_bits(bits):
        """The integers i of `bits` = 0x4B400000 + i (|i| < 2^22) as float32, exactly: no conversion
        instruction, one subtraction."""
        return bits.to(tl.float32, bitcast=True) - 12582912.0

    @triton.jit
    def _codes_to_float(codes):
        """Float32 values of INT8 codes without an integer → float conversion (see
        quantize_int8): 0x4B400000 + code as bits is the float 1.5·2^23 + code, exactly. Other
        dtypes (FP8 codes, float residuals) convert as usual."""
        if codes.dtype == tl.int8:
            if COMPILED:
                return _packed_codes_to_float(codes)
            return _decode_offset_bits(codes.to(tl.int32) + _OFFSET_BITS)
        return codes.to(tl.float32)

    @triton.jit
    def _packed_codes_to_float(codes):
        """_codes_to_float of INT8 codes, four to a word: an exclusive or maps the four codes to
        code + 128 (0..255) at once, and one byte permute per code puts it under 0x4B40_00, the
        bits of the float 1.5·2^23 + code + 128. Compiled, the sign extension and integer add per
        code took two instructions (sm_90: byte permute, add; ResNet-50's layer1 conv3 epilogue)."""
        bits = tl.inline_asm_elementwise(
            """{
            .reg .b32 flipped, exponent;
            xor.b32 flipped, $4, 0x80808080;
            mov.b32 exponent, 0x4B400000;
            prmt.b32 $0, flipped, exponent, 0x7650;
            prmt.b32 $1, flipped, exponent, 0x7651;
            prmt.b32 $2, flipped, exponent, 0x7652;
            prmt.b32 $3, flipped, exponent, 0x7653;
            }""",
            "=r,=r,=r,=r,r", [codes], dtype=tl.int32, is_pure=True, pack=4)
        return bits.to(tl.float32, bitcast=True) - 12583040.0

    @triton.jit
    def round_to_fp8_grid(v, inv_scale):
        """clamp(v · inv_scale, ±448) rounded to the e4m3 grid (ties to even), still float32: the
        grid step is 2^(e-3) for a value in [2^e, 2^(e+1)), and 2^-9 below 2^-6 (subnormals)."""
        v = v * inv_scale
        # NaN stays NaN, as the emulation's cast keeps it (a GPU maximum/minimum returns the
        # other operand, which would turn NaN into -448).
        v = tl.where(v == v, tl.minimum(tl.maximum(v, -448.0), 448.0), v)
        exponent = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent-3)
        inv_step = ((130 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(3-exponent)
        return _round_half_even(v * inv_step) * step

    @triton.jit
    def stored_codes(v, in_inv_scale, qmin, QUANTIZE: tl.constexpr, FP8: tl.constexpr):
        """What a kernel that lays out a layer's input codes (im2col's columns, the stem's packed
        pixels) stores for the loaded `v`: with QUANTIZE a float value quantized to INT8 or to the
        e4m3 grid as the emulation quantizes it, else codes already made, as they are."""
        if QUANTIZE:
            if FP8:
                v = round_to_fp8_grid(v.to(tl.float32), in_inv_scale).to(tl.float8e4nv)
            else:
                v = quantize_int8(v.to(tl.float32), in_inv_scale, qmin)
        return v

    # Compiled kernels round float32 → e4m3 with the hardware's conversion (cvt.rn.satfinite: to
    # nearest, ties to even, subnormals kept, ±448 for whatever lies beyond, NaN kept), which is
    # round_to_fp8_grid's result without its twenty-odd instructions per value, which made FP8 1×1 layers
    # up to twice as long as INT8's (docs/decisions/kernel-tile-steps-rounding.md).
    # Triton's interpreter does not round to nearest, so interpreted kernels keep the arithmetic.
    # Whether this module's kernels are interpreted is decided once, as @triton.jit made them.
    FP8_HARDWARE_ROUNDING = tl.constexpr(not isinstance(round_to_fp8_grid, InterpretedFunction))
    # The same decision for the epilogue's fused multiply-adds (interpreted: _fma_round_to_odd) and
    # its inline PTX (_packed_codes_to_float), which the interpreter cannot run.
    COMPILED = FP8_HARDWARE_ROUNDING
    _SUMS_DECODED = tl.constexpr(SUMS_DECODED)
    _CODES_ABOVE_FLOOR = tl.constexpr(CODES_ABOVE_FLOOR)

    @triton.jit
    def accumulate_dot(acc, a, b, in_inv_scale, qmin, INT8: tl.constexpr, FP8: tl.constexpr,
                    QUANTIZE_INPUT: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc += a·b on the tensor cores; float A tiles of an INT8 (FP8) layer are quantized first."""
        if QUANTIZE_INPUT:
            if FP8:
                a = round_to_fp8_grid(a.to(tl.float32), in_inv_scale).to(tl.float8e4nv)
            else:
                a = quantize_operand(a.to(tl.float32), in_inv_scale, qmin)
        if INT8:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        elif FP8:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _add_residual(y, residual, res_scale, RES_QUANT: tl.constexpr):
        """The residual added to y: stored codes (as float32) with their scale in one fused
        multiply-add, float residuals as they are."""
        if RES_QUANT:
            return _add_scaled_residual(y, residual, res_scale)
        return y + residual

    @triton.jit
    def _load_residual(res_ptr, offs_n, out_mask, n_idx, oh, ow, srn, src, srh, srw):
        """The residual's tile for these output pixels and channels, as stored (codes or floats)."""
        r_row = n_idx.to(tl.int64) * srn + oh * srh + ow * srw
        return tl.load(res_ptr + r_row[:, None] + offs_n[None, :] * src, mask=out_mask, other=0.0)

    @triton.jit
    def store_epilogue(acc, offs_m, offs_n, m_ok, n_ok, n_idx, oh, ow, bias_ptr, scale_ptr, res_ptr, y_ptr,
                        y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                        INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                        RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
                        OUT_QUANT: tl.constexpr):
        """Bias, dequantize, residual, activation, requantize and the store of one output tile."""
        residual = 0.0
        if HAS_RES:
            residual = _load_residual(res_ptr, offs_n, m_ok[:, None] & n_ok[None, :], n_idx, oh, ow, srn, src, srh, srw)
        _epilogue_store_given(acc, residual, offs_m, offs_n, m_ok, n_ok, bias_ptr, scale_ptr, y_ptr, y_row, res_scale,
                              out_inv_scale, qmin, alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER,
                              ACT, OUT_QUANT)

    @triton.jit
    def dequantize_tile(acc, offs_n, n_ok, bias_ptr, scale_ptr, INT8: tl.constexpr, FP8: tl.constexpr,
                         HAS_BIAS: tl.constexpr, LOADED: tl.constexpr = False):
        """An accumulator tile with its bias, dequantized to float32 (a float layer's: plus its bias).
        LOADED: `bias_ptr` and `scale_ptr` are the columns' values already (`load_column_values`)."""
        if LOADED:
            bias, scale = bias_ptr, scale_ptr
        else:
            bias, scale = load_column_values(offs_n, n_ok, bias_ptr, scale_ptr, INT8, FP8, HAS_BIAS)
        if INT8 == _SUMS_DECODED:
            # The bias and 0x4B400000 are added to the columns first: one integer add per sum.
            if HAS_BIAS:
                acc += (bias + _OFFSET_BITS)[None, :]
            else:
                acc += _OFFSET_BITS
            y = _decode_offset_bits(acc) * scale[None, :]
        elif INT8:
            if HAS_BIAS:
                acc += bias[None, :]
            y = acc.to(tl.float32) * scale[None, :]
        elif FP8:  # the float32 bias comes after the scale
            y = acc * scale[None, :]
            if HAS_BIAS:
                y += bias[None, :]
        else:
            y = acc
            if HAS_BIAS:
                y += bias.to(tl.float32)[None, :]
        return y

    @triton.jit
    def load_column_values(offs_n, n_ok, bias_ptr, scale_ptr, INT8: tl.constexpr, FP8: tl.constexpr,
                       HAS_BIAS: tl.constexpr):
        """These columns' bias (0 without one) and dequant scale (1 for a float layer)."""
        bias = 0
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0)
        scale = 1.0
        if INT8 or FP8:
            scale = tl.load(scale_ptr + offs_n, mask=n_ok, other=0.0)
        return bias, scale

    @triton.jit
    def load_column_halves(first_column, COUT, bias_ptr, scale_ptr, INT8: tl.constexpr, FP8: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
        """load_column_values of a tile's two column halves, as `store_epilogue_halves_loaded` takes them:
        (bias_lo, scale_lo, bias_hi, scale_hi). A program that stores several row tiles of the same
        columns loads them once (ResidentTile "cols-loaded")."""
        first = first_column + tl.arange(0, BLOCK_N // 2)
        bias_lo, scale_lo = load_column_values(first, first < COUT, bias_ptr, scale_ptr, INT8, FP8, HAS_BIAS)
        second = first + BLOCK_N // 2
        bias_hi, scale_hi = load_column_values(second, second < COUT, bias_ptr, scale_ptr, INT8, FP8, HAS_BIAS)
        return bias_lo, scale_lo, bias_hi, scale_hi

    @triton.jit
    def _epilogue_store_given(acc, residual, offs_m, offs_n, m_ok, n_ok, bias_ptr, scale_ptr, y_ptr, y_row, res_scale,
                              out_inv_scale, qmin, alpha, beta, INT8: tl.constexpr, FP8: tl.constexpr,
                              HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr,
                              RES_AFTER: tl.constexpr, ACT: tl.constexpr, OUT_QUANT: tl.constexpr,
                              LOADED: tl.constexpr = False):
        """store_epilogue with the residual's tile already loaded (`_load_residual`; unused
        without HAS_RES): a kernel may load it early, so that its latency hides behind the product.
        LOADED: `bias_ptr` and `scale_ptr` hold the columns' values (`dequantize_tile`)."""
        y = epilogue_output(acc, residual, offs_n, n_ok, bias_ptr, scale_ptr, res_scale, out_inv_scale, qmin, alpha,
                             beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT, LOADED)
        y_offsets = offs_m.to(tl.int64)[:, None] * y_row + offs_n[None, :]
        tl.store(y_ptr + y_offsets, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def epilogue_output(acc, residual, offs_n, n_ok, bias_ptr, scale_ptr, res_scale, out_inv_scale, qmin, alpha, beta,
                         INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                         RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
                         OUT_QUANT: tl.constexpr, LOADED: tl.constexpr = False):
        """The epilogue's values of one tile as they are stored: bias, dequantization, residual,
        activation, then with OUT_QUANT the output codes (INT8, or e4m3 as float32 interpreted), else
        float32. A kernel that goes on with the codes (the stem's max pool, `window/resident.py`)
        takes them here."""
        y = dequantize_tile(acc, offs_n, n_ok, bias_ptr, scale_ptr, INT8, FP8, HAS_BIAS, LOADED)
        if HAS_RES:
            if RES_QUANT:
                residual = _codes_to_float(residual)
            else:
                residual = residual.to(tl.float32)
            if not RES_AFTER:
                y = _add_residual(y, residual, res_scale, RES_QUANT)
        y = activate(y, ACT, alpha, beta)
        if HAS_RES:
            if RES_AFTER:
                y = _add_residual(y, residual, res_scale, RES_QUANT)
        if OUT_QUANT:
            if FP8:
                if FP8_HARDWARE_ROUNDING:
                    y = (y * out_inv_scale).to(tl.float8e4nv)
                else:
                    y = round_to_fp8_grid(y, out_inv_scale)
            elif OUT_QUANT == _CODES_ABOVE_FLOOR:  # the activation's least value rounds to qmin or above
                y = _requantize_code_above_floor(y, out_inv_scale)
            else:
                y = requantize_int8(y, out_inv_scale, qmin)
        return y

    @triton.jit
    def store_epilogue_halves(acc, offs_m, first_column, COUT, m_ok, n_idx, oh, ow, bias_ptr, scale_ptr, res_ptr,
                               y_ptr, y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                               INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                               RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr, ACT: tl.constexpr,
                               OUT_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """store_epilogue over two halves of the tile's columns in turn: half of the float32 values
        and of the residual live at once (bench/kernel_asm.py: 96 → 61 registers for ResNet-50's
        layer1 conv3 in the 64×64 tile), with no layout conversion added."""
        lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        first = first_column + tl.arange(0, BLOCK_N // 2)
        store_epilogue(lo, offs_m, first, m_ok, first < COUT, n_idx, oh, ow, bias_ptr, scale_ptr, res_ptr, y_ptr,
                        y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                        INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT)
        second = first + BLOCK_N // 2
        store_epilogue(hi, offs_m, second, m_ok, second < COUT, n_idx, oh, ow, bias_ptr, scale_ptr, res_ptr, y_ptr,
                        y_row, srn, src, srh, srw, res_scale, out_inv_scale, qmin, alpha, beta,
                        INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT, RES_AFTER, ACT, OUT_QUANT)

    @triton.jit
    def load_residual_halves(res_ptr, first_column, COUT, m_ok, n_idx, oh, ow, srn, src, srh, srw,
                         BLOCK_N: tl.constexpr):
        """The residual's tile in the two column halves `store_epilogue_halves_given` takes."""
        first = first_column + tl.arange(0, BLOCK_N // 2)
        second = first + BLOCK_N // 2
        lo = _load_residual(res_ptr, first, m_ok[:, None] & (first < COUT)[None, :], n_idx, oh, ow, srn, src, srh, srw)
        hi = _load_residual(res_ptr, second, m_ok[:, None] & (second < COUT)[None, :], n_idx, oh, ow, srn, src, srh,
                            srw)
        return lo, hi

    @triton.jit
    def load_residual_tile(res_ptr, first_column, COUT, m_ok, n_idx, oh, ow, srn, src, srh, srw, BLOCK_N: tl.constexpr):
        """The residual's whole tile (BLOCK_N columns from `first_column`), as stored."""
        offs_n = first_column + tl.arange(0, BLOCK_N)
        return _load_residual(res_ptr, offs_n, m_ok[:, None] & (offs_n < COUT)[None, :], n_idx, oh, ow, srn, src, srh,
                              srw)

    @triton.jit
    def decode_codes_through_mma(codes, identity, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  DECODE_BITS: tl.constexpr = False):
        """A residual tile of INT8 codes (`load_residual_tile`) as float32 in the accumulator's own
        layout, in the two column halves the epilogue takes: codes · I on the tensor cores, converted
        exactly. Loaded into registers (`load_residual_halves`), the codes sit in a coalesced layout, so
        the compiler converted the float32 products to it through shared memory before adding them:
        16 KB a 64×64 tile, with bank conflicts on its stores
        (docs/decisions/kernel-tile-steps-rounding.md). As a product's operand the codes go through
        shared memory once, as
        bytes, and come back in the accumulator's layout. `identity`: the BLOCK_N × BLOCK_N identity
        in INT8 (`int8_identity`).

        The int32 sums become float32 by a conversion instruction, or with DECODE_BITS without one:
        the product accumulates onto 0x4B400000, the bits of 1.5·2^23, so each sum's bits are the
        float 1.5·2^23 + code exactly (see _codes_to_float) and one subtraction decodes it. On sm_90
        that is 32 more instructions per thread and 64×64 tile (moves of the initial value, the
        subtractions) for 32 fewer conversions; conversions issue at 16 a clock per SM, a quarter
        of the integer rate and an eighth of float additions (CUDA programming guide; Triton
        replaced Hopper's int8 → bf16 conversions with bit operations for that, triton-lang/triton
        #4563), so the builder times both."""
        if DECODE_BITS:
            bits = tl.dot(codes, identity, tl.full((BLOCK_M, BLOCK_N), _OFFSET_BITS, tl.int32), out_dtype=tl.int32)
            values = _decode_offset_bits(bits)
        else:
            values = tl.dot(codes, identity, tl.zeros((BLOCK_M, BLOCK_N), tl.int32),
                            out_dtype=tl.int32).to(tl.float32)
        return tl.split(tl.permute(tl.reshape(values, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))

    @triton.jit
    def int8_identity(BLOCK_N: tl.constexpr):
        """The BLOCK_N × BLOCK_N identity in INT8, `decode_codes_through_mma`'s second operand."""
        rows = tl.arange(0, BLOCK_N)
        return (rows[:, None] == rows[None, :]).to(tl.int8)

    @triton.jit
    def store_epilogue_halves_given(acc, res_lo, res_hi, offs_m, first_column, COUT, m_ok, bias_ptr, scale_ptr,
                                     y_ptr, y_row, res_scale, out_inv_scale, qmin, alpha, beta,
                                     INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
                                     HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr,
                                     ACT: tl.constexpr, OUT_QUANT: tl.constexpr, BLOCK_M: tl.constexpr,
                                     BLOCK_N: tl.constexpr):
        """store_epilogue_halves with the residual's halves already loaded (`load_residual_halves`)."""
        lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        first = first_column + tl.arange(0, BLOCK_N // 2)
        _epilogue_store_given(lo, res_lo, offs_m, first, m_ok, first < COUT, bias_ptr, scale_ptr, y_ptr, y_row,
                              res_scale, out_inv_scale, qmin, alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT,
                              RES_AFTER, ACT, OUT_QUANT)
        second = first + BLOCK_N // 2
        _epilogue_store_given(hi, res_hi, offs_m, second, m_ok, second < COUT, bias_ptr, scale_ptr, y_ptr, y_row,
                              res_scale, out_inv_scale, qmin, alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT,
                              RES_AFTER, ACT, OUT_QUANT)

    @triton.jit
    def store_epilogue_halves_loaded(acc, res_lo, res_hi, offs_m, first_column, COUT, m_ok, bias_lo, bias_hi,
                                      scale_lo, scale_hi, y_ptr, y_row, res_scale, out_inv_scale, qmin, alpha, beta,
                                      INT8: tl.constexpr, FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
                                      HAS_RES: tl.constexpr, RES_QUANT: tl.constexpr, RES_AFTER: tl.constexpr,
                                      ACT: tl.constexpr, OUT_QUANT: tl.constexpr, BLOCK_M: tl.constexpr,
                                      BLOCK_N: tl.constexpr):
        """store_epilogue_halves_given with each half's bias and scale loaded before (`load_column_values`),
        for a program that stores several row tiles of the same columns."""
        lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        first = first_column + tl.arange(0, BLOCK_N // 2)
        _epilogue_store_given(lo, res_lo, offs_m, first, m_ok, first < COUT, bias_lo, scale_lo, y_ptr, y_row,
                              res_scale, out_inv_scale, qmin, alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT,
                              RES_AFTER, ACT, OUT_QUANT, LOADED=True)
        second = first + BLOCK_N // 2
        _epilogue_store_given(hi, res_hi, offs_m, second, m_ok, second < COUT, bias_hi, scale_hi, y_ptr, y_row,
                              res_scale, out_inv_scale, qmin, alpha, beta, INT8, FP8, HAS_BIAS, HAS_RES, RES_QUANT,
                              RES_AFTER, ACT, OUT_QUANT, LOADED=True)


def residual_pixels(residual_strides: tuple, batch: int, out_hw: tuple) -> tuple[tuple, tuple]:
    """The output size (OH, OW) and residual strides (n, c, h, w) with which a kernel that needs
    output coordinates for its residual alone (1×1 stride-1 layers: the resident and TMA GEMM
    kernels) addresses it. Where the residual's pixels lie evenly spaced in output order (a whole
    NHWC tensor or a channel slice of one; or no residual, strides all 0), the output is taken as
    batch·OH·OW pixels of 1 × 1: OH = OW = 1 compile as constants and `pixel_coords`' divisions per
    row go (on sm_90, 71 of the 508 instructions per row tile of layer1 conv3's resident 64×64 tile).
    Otherwise both are returned as they are."""
    oh, ow = out_hw
    sn, sc, sh, sw = residual_strides
    step = sw if ow > 1 else sh if oh > 1 else sn
    if (ow == 1 or sw == step) and (oh == 1 or sh == ow * step) and (batch == 1 or sn == oh * ow * step):
        return (1, 1), (step, sc, step, step)
    return (oh, ow), (sn, sc, sh, sw)


def sums_decoded(accumulator_bound: int | None) -> bool:
    """Whether an INT8 layer of this accumulator bound (`passes/bound_accumulators.py`; None: not
    known) decodes its sums from their bits (SUMS_DECODED)."""
    return accumulator_bound is not None and accumulator_bound < DECODABLE_SUM


# The least value of each activation bounded below, by ACTIVATION_CODES (Clip's is its alpha):
# ReLU, Sigmoid and HardSigmoid 0; SiLU x·σ(x) at x = -1.2785; HardSwish at x = -1.5; GELU at
# x = -0.7518; Tanh -1.
ACTIVATION_FLOORS = {"Relu": 0.0, "Sigmoid": 0.0, "HardSigmoid": 0.0, "SiLU": -0.2784645427610738,
                     "HardSwish": -0.375, "Gelu": -0.16997120747990094, "Tanh": -1.0}
# Kept from the floor: the GPU's approximate exponential and reciprocal (SiLU, Sigmoid, Tanh) and
# erf (GELU) may land a few units of the last place beyond the exact least value.
FLOOR_MARGIN = 1e-3


def output_codes(activation: str | None, alpha: float | None, residual_after_activation: bool,
                 output_inv_scale: float, qmin: float) -> int:
    """OUT_QUANT of an INT8 epilogue: CODES_ABOVE_FLOOR where the activation is the last step (no
    residual after it) and its least value, less FLOOR_MARGIN of it, times the output's inverse
    scale rounds to qmin or above, so that the lower clamp, one instruction an output value, never
    binds; else CODES. The codes are the same either way."""
    floor = alpha if activation == "Clip" and alpha is not None else ACTIVATION_FLOORS.get(activation)
    if floor is None or residual_after_activation:
        return CODES
    lowest = (floor - abs(floor) * FLOOR_MARGIN) * output_inv_scale
    return CODES_ABOVE_FLOOR if lowest > qmin - 0.5 else CODES


def epilogue_arguments(*, quantized: bool, fp8: bool, bias: torch.Tensor | None, residual: torch.Tensor | None,
                       activation: str | None, alpha: float | None, beta: float | None,
                       residual_after_activation: bool, residual_scale: float | None,
                       output_inv_scale: float | None, qmin: float,
                       accumulator_bound: int | None = None) -> tuple[tuple, dict]:
    """The fused epilogue's arguments as this family's kernels take them (`store_epilogue`): the
    runtime scalars (residual scale, output inverse scale, qmin, alpha, beta) and the constexpr
    flags. `accumulator_bound`: a bound on |sum + bias| of an INT8 layer's accumulators
    (`passes/bound_accumulators.py`), below DECODABLE_SUM for the sums to be decoded from their bits."""
    code_dtype = torch.float8_e4m3fn if fp8 else torch.int8
    scalars = (float(residual_scale or 1.0), float(output_inv_scale or 1.0), float(qmin),
               float(alpha) if alpha is not None else 0.0, float(beta) if beta is not None else 0.0)
    int8_sums = SUMS_DECODED if sums_decoded(accumulator_bound) else SUMS_CONVERTED
    flags = dict(INT8=int8_sums if quantized and not fp8 else False, FP8=quantized and fp8,
                 HAS_BIAS=bias is not None, HAS_RES=residual is not None,
                 RES_QUANT=residual is not None and residual.dtype == code_dtype,
                 RES_AFTER=bool(residual_after_activation), ACT=ACTIVATION_CODES[activation],
                 OUT_QUANT=0 if not quantized or output_inv_scale is None else
                 CODES if fp8 else output_codes(activation, alpha, residual_after_activation, output_inv_scale, qmin))
    return scalars, flags


settle_cache_keys(globals())  # last, once every Triton function above exists (common/cache_keys.py)
