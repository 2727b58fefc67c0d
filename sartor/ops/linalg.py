"""Matrix products: Gemm, MatMul and the fused GEMM the passes produce."""
from __future__ import annotations

import torch

from .elementwise import apply_activation
from .registry import REQUIRED, OpTable
from ..ir.dtypes import FLOAT_DTYPES
from .util import only_dtypes, same_device

OPS = OpTable("linalg")


@OPS.op("Gemm", attrs={"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0})
def gemm(inputs, attrs):
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    if attrs["transA"]:
        a = a.t()
    if attrs["transB"]:
        b = b.t()
    b = b.to(a.dtype)
    if c is not None and a.dim() == 2 and c.dim() <= 2:
        # cuBLAS/MKL add the bias inside the product (one pass instead of two).
        c = same_device(c, a).to(a.dtype)
        return torch.addmm(c, a, b, beta=attrs["beta"], alpha=attrs["alpha"])
    y = a @ b
    if attrs["alpha"] != 1.0:
        y = y * attrs["alpha"]
    if c is not None:
        c = same_device(c, y).to(y.dtype)
        y = y + (c * attrs["beta"] if attrs["beta"] != 1.0 else c)
    return y


@OPS.internal("FusedGemm")
def fused_gemm(inputs, attrs):
    """Gemm (+residual) (+activation) epilogue."""
    y = gemm(inputs[:3], {k: attrs.get(k, d) for k, d in (("alpha", 1.0), ("beta", 1.0), ("transA", 0), ("transB", 0))})
    if attrs.get("activation"):
        y = apply_activation(y, attrs["activation"], attrs.get("activation_alpha"), attrs.get("activation_beta"))
    return y


@OPS.op("MatMul")
def matmul(inputs, attrs):
    a, b = inputs
    if not a.is_floating_point():
        return torch.matmul(a.to(torch.int64), b.to(torch.int64)).to(torch.promote_types(a.dtype, b.dtype))
    return torch.matmul(a, b.to(a.dtype))


@OPS.internal("Linear")
def linear(inputs, attrs):
    """x [..., K] @ w [K, C] + b [C] as one GEMM with the bias in its epilogue (a MatMul and its bias
    Add, fused by passes/fuse_linear_bias.py)."""
    x, w, b = inputs
    w = w.to(x.dtype)
    b = same_device(b, x).to(x.dtype).reshape(-1)
    if x.dim() == 1:
        return x @ w + b
    if x.dim() == 2:
        return torch.addmm(b, x, w)
    return torch.addmm(b, x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


@OPS.op("MatMulInteger")
def matmul_integer(inputs, attrs):
    a, b = inputs[0].to(torch.int32), inputs[1].to(torch.int32)
    if len(inputs) > 2 and inputs[2] is not None:
        zp = inputs[2].to(torch.int32)
        # a 1-D a_zero_point holds one value per row of a (b's, one per column, broadcasts as is)
        a = a - (zp.reshape(-1, 1) if zp.dim() == 1 and zp.numel() > 1 and a.dim() >= 2 else zp)
    if len(inputs) > 3 and inputs[3] is not None:
        b = b - inputs[3].to(torch.int32)
    return torch.matmul(a.to(torch.int64), b.to(torch.int64)).to(torch.int32)


@OPS.op("Einsum", attrs={"equation": REQUIRED})
def einsum(inputs, attrs):
    equation = attrs["equation"].replace(" ", "")
    dtype = inputs[0].dtype
    if dtype in (torch.float16, torch.bfloat16):  # accumulate in FP32, as the ONNX reference does
        return torch.einsum(equation, *[t.float() for t in inputs]).to(dtype)
    if not dtype.is_floating_point:  # integer einsum is not implemented by every torch backend
        return torch.einsum(equation, *[t.to(torch.int64) for t in inputs]).to(dtype)
    return torch.einsum(equation, *inputs)


@OPS.op("Det", check=only_dtypes(set(FLOAT_DTYPES)))
def det(inputs, attrs):
    x = inputs[0]
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return torch.linalg.det(x.to(compute)).to(x.dtype)
