"""The op registry: each op is declared once and read by the importer, the passes and the executor.

An op family module makes an `OpTable` and decorates its reference implementations:

    OPS = OpTable("elementwise")

    @OPS.op("Relu")
    def relu(inputs, attrs):
        return torch.relu(inputs[0])

Implementations take the node's inputs as torch tensors (None for an omitted optional input) and
its attributes with defaults filled in, and return one tensor or a tuple of tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from ..ir.dtypes import NUMPY_TO_TORCH

REQUIRED = object()  # marks an attribute without a default
# The attribute an op declared with `stores_any_float` reads: the name of the float dtype ("float16",
# "float32", ...) to store its float output in, set by the executor (runtime/float_outputs.py).
FLOAT_OUTPUT = "float_output"
ANY_ATTRS = object()  # an op that accepts any attribute set (internal ops only)


def stored_float_dtype(attrs: dict, default: torch.dtype | None = None) -> torch.dtype | None:
    """The float dtype a `stores_any_float` op stores its float output in: the one its FLOAT_OUTPUT
    attribute names, else `default`."""
    return NUMPY_TO_TORCH[attrs[FLOAT_OUTPUT]] if FLOAT_OUTPUT in attrs else default


Impl = Callable[[list, dict], Any]
# A check sees the node's attributes (defaults filled) and its input dtypes (numpy names, None if
# unknown) and returns a reason when this use of the op is unsupported.
Check = Callable[[dict, list], Optional[str]]


@dataclass(frozen=True)
class OpDef:
    name: str
    impl: Impl
    family: str
    attrs: dict = field(default_factory=dict)
    # Inputs read as Python values (shapes, axes, sizes): always kept on the host so that reading
    # them never synchronises the device or breaks CUDA-graph capture.
    host_inputs: tuple = ()
    # Cheap integer arithmetic that may run on the host when all its inputs are host values
    # (the "shape tensor" subgraphs that exporters emit around Reshape and Resize).
    shape_arith: bool = False
    check: Optional[Check] = None
    # Output size depends on input values: the device must be read back, so a run holding such an
    # op cannot be captured as a CUDA graph.
    data_dependent_shape: bool = False
    # False for an op whose implementation reads device values on the host (a sync CUDA graphs
    # cannot record): its layer runs between captured segments (runtime/capture.py).
    capturable: bool = True
    domain: str = ""
    # Layers with several implementations (tactics): `tactics(inputs, attrs, effort)` lists the
    # candidates for these arguments, the reference first; `weight_for_tactic(weight, tactic)` is
    # the weight (input 1) in the layout that tactic reads, stored so once at load.
    tactics: Optional[Callable[[list, dict, int], list]] = None
    weight_for_tactic: Optional[Callable[[Any, Optional[str]], Any]] = None
    # `constant_dtype(position, attrs, compute_dtype)`: the float dtype a constant input is stored in,
    # None to keep its own, where not every constant takes the layer's compute dtype (a mixed chain).
    constant_dtype: Optional[Callable[[int, dict, Any], Any]] = None
    # `write_into(inputs, attrs, out)`: the op's one output stored straight into `out` (a channel
    # slice of a Concat's buffer, see runtime/concat_plan.py), returning it; None where the chosen
    # tactic cannot: the op then runs as usual and the Concat copies its result.
    write_into: Optional[Callable[[list, dict, Any], Any]] = None
    # `write_outputs(inputs, attrs, outs)`: the op run with `outs` (graph outputs: a context's shared
    # output buffers, contiguous, each of the shape and dtype its run made before, holding the last
    # run's values), returning its outputs: written into `outs` where the chosen tactic can, else made
    # as usual, and the context then copies them there (runtime/context.py); None where `outs` does not
    # fit, and the op runs as usual.
    write_outputs: Optional[Callable[[list, dict, list], Any]] = None
    # The tactic that runs what PyTorch eager runs for this op, where that is not the reference
    # (attention: SDPA); the build's eager check times the engine against these (builder/eager_check.py).
    eager_tactic: Optional[str] = None
    # The op stores its one float output in the dtype its FLOAT_OUTPUT attribute names (by default
    # the dtype it computes in), so that the executor can store it as its readers or the graph's
    # output want it, sparing them a conversion (runtime/float_outputs.py).
    stores_any_float: bool = False

    def fill_attrs(self, given: dict) -> dict:
        if self.attrs is ANY_ATTRS:
            return dict(given)
        filled = {}
        if self.tactics is not None and "tactic" in given:  # the builder's choice, kept for the executor
            filled["tactic"] = given["tactic"]
        for key, default in self.attrs.items():
            if key in given:
                filled[key] = given[key]
            elif default is not REQUIRED:
                filled[key] = default
        return filled

    def unsupported_reason(self, given_attrs: dict, input_dtypes: list) -> Optional[str]:
        if self.attrs is not ANY_ATTRS:
            unknown = sorted(set(given_attrs) - set(self.attrs) - ({"tactic"} if self.tactics else set()))
            if unknown:
                return f"attribute(s) {', '.join(unknown)} not supported"
            missing = [k for k, v in self.attrs.items() if v is REQUIRED and k not in given_attrs]
            if missing:
                return f"required attribute(s) {', '.join(missing)} missing"
        if self.check is not None:
            return self.check(self.fill_attrs(given_attrs), input_dtypes)
        return None


class OpTable:
    """The ops of one family; `OpRegistry` merges the tables."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.defs: dict[tuple, OpDef] = {}

    def op(self, *names: str, attrs: dict | None = None, host_inputs: Iterable[int] = (),
           shape_arith: bool = False, check: Check | None = None, data_dependent_shape: bool = False,
           capturable: bool = True, domain: str = "", tactics: Callable | None = None,
           weight_for_tactic: Callable | None = None, write_into: Callable | None = None,
           write_outputs: Callable | None = None, eager_tactic: str | None = None,
           stores_any_float: bool = False, constant_dtype: Callable | None = None) -> Callable[[Impl], Impl]:
        def register(impl: Impl) -> Impl:
            for name in names:
                key = (domain, name)
                if key in self.defs:
                    raise RuntimeError(f"op {name} registered twice in {self.family}")
                self.defs[key] = OpDef(name=name, impl=impl, family=self.family,
                                       attrs={} if attrs is None else attrs,
                                       host_inputs=tuple(host_inputs), shape_arith=shape_arith,
                                       check=check, data_dependent_shape=data_dependent_shape,
                                       capturable=capturable, domain=domain,
                                       tactics=tactics, weight_for_tactic=weight_for_tactic,
                                       write_into=write_into, write_outputs=write_outputs,
                                       eager_tactic=eager_tactic,
                                       stores_any_float=stores_any_float, constant_dtype=constant_dtype)
            return impl
        return register

    def internal(self, *names: str, **kwargs) -> Callable[[Impl], Impl]:
        """An op made by sartor's passes, not by ONNX exporters."""
        return self.op(*names, domain="sartor", attrs=ANY_ATTRS, **kwargs)


class OpRegistry:
    def __init__(self, tables: Iterable[OpTable]) -> None:
        self._defs: dict[tuple, OpDef] = {}
        for table in tables:
            for key, opdef in table.defs.items():
                if key in self._defs:
                    raise RuntimeError(f"op {key} registered by {self._defs[key].family} and {table.family}")
                self._defs[key] = opdef

    def get(self, op_type: str, domain: str = "") -> OpDef | None:
        return self._defs.get((domain, op_type)) or self._defs.get(("sartor", op_type))

    def __contains__(self, op_type: str) -> bool:
        return self.get(op_type) is not None

    def onnx_op_types(self) -> list[str]:
        return sorted(name for (domain, name) in self._defs if domain == "")

    def __getitem__(self, op_type: str) -> OpDef:
        opdef = self.get(op_type)
        if opdef is None:
            raise KeyError(op_type)
        return opdef
