"""Library GEMM tactics of INT8 (FP8) 1×1 convolutions and GEMMs: cuBLAS through torch,
`torch._int_mm` (int8 × int8 → int32) and `torch._scaled_mm` (e4m3 × e4m3 → float32), then the
layer's epilogue in one Triton kernel (`accumulator_epilogue`, the split-K epilogue with one share).

Issue 5 asks for the libraries' kernels among the candidates, as TensorRT times cuBLAS/cuDNN beside
its own. Their int32 accumulators make a round trip through memory, so the builder's timing decides
where they pay (docs/decisions/kernel-library-gemms.md).

INT8: the integer sums are exact, so the output is the emulation's bit for bit. FP8: cuBLAS adds
the products in float32 in its own order; the tactic check's FP8 tolerance covers it.
"""
from __future__ import annotations

import torch

from ..kernels.conv.igemm import ConvGeometry, accumulator_epilogue
from ..kernels.pointwise.epilogue import pixel_stride
from ..kernels.registry import PACKED_K_MAJOR, fixed_tactic

INT_MM = "cublas_int_mm"
SCALED_MM = "cublas_scaled_mm"
LIBRARY_TACTICS = (INT_MM, SCALED_MM)
fixed_tactic(INT_MM, "cuBLAS int8 GEMM (torch._int_mm, int32 accumulate) + triton epilogue",
             weight_layout=PACKED_K_MAJOR)
fixed_tactic(SCALED_MM, "cuBLAS fp8 e4m3 GEMM (torch._scaled_mm, fp32 accumulate) + triton epilogue",
             weight_layout=PACKED_K_MAJOR)
MIN_ROWS = 17  # torch._int_mm on CUDA wants more than 16 rows
DIM_MULTIPLE = 16  # cuBLAS FP8 GEMMs want K and N multiples of 16 (INT8: 8); 16 for both


def library_tactics(fp8: bool) -> list[str]:
    return [SCALED_MM if fp8 else INT_MM]


def library_applies(x: torch.Tensor, wq: torch.Tensor, geometry: ConvGeometry | None) -> bool:
    """GEMMs over a row-major [M, K] input, and 1×1, stride-1, unpadded convolutions over a dense
    channels-last input (pixels exactly C apart, so that [N·H·W, C] is a view), with more than 16
    rows and K and Cout multiples of 16."""
    cout, k = wq.shape[0], wq.shape[1]
    if k % DIM_MULTIPLE or cout % DIM_MULTIPLE or (wq.dim() == 4 and tuple(wq.shape[2:]) != (1, 1)):
        return False
    if x.dim() == 2:
        return x.is_contiguous() and x.shape[0] >= MIN_ROWS and x.shape[1] == k
    if x.dim() != 4 or geometry is None or pixel_stride(x) != x.shape[1] or x.shape[1] != k:
        return False
    return (geometry.kernel == (1, 1) and geometry.strides == (1, 1) and geometry.pads == (0, 0)
            and tuple(geometry.out_hw) == tuple(x.shape[2:]) and x.shape[0] * x.shape[2] * x.shape[3] >= MIN_ROWS)


def library_qlayer(codes: torch.Tensor, w_packed: torch.Tensor, tactic: str, bias: torch.Tensor | None,
                   residual: torch.Tensor | None, dequant_scale: torch.Tensor, epilogue: dict,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The layer through the library GEMM `tactic` over the input's codes (int8 or e4m3, already
    quantized: [M, K], or [N, K, H, W] dense channels-last) and the packed weight [Cout, K(, 1, 1)];
    `epilogue`: the layer's conv_igemm epilogue arguments. Channels-last output (or `out`)."""
    cout, k = w_packed.shape[0], w_packed.shape[1]
    rows = codes if codes.dim() == 2 else codes.permute(0, 2, 3, 1).reshape(-1, k)  # a view: dense pixels
    weight = w_packed.reshape(cout, k).t()  # [K, Cout] column-major, as cuBLAS takes the second operand
    if tactic == INT_MM:
        acc = torch._int_mm(rows, weight)
    else:
        one = torch.ones((), dtype=torch.float32, device=codes.device)
        acc = torch._scaled_mm(rows, weight, scale_a=one, scale_b=one, out_dtype=torch.float32)
    shape = (codes.shape[0], cout, *codes.shape[2:]) if codes.dim() == 4 else (codes.shape[0], cout)
    arguments = {key: value for key, value in epilogue.items() if key != "input_inv_scale"}
    return accumulator_epilogue(acc, shape, bias, dequant_scale=dequant_scale, residual=residual, out=out,
                                **arguments)
