"""A chain of data-movement ops that keeps the last axis becomes one RowGather: the output's rows are
the input's rows through a constant per-image table.

Swin writes its cyclic shift as Slice + Slice + Concat per axis, its window partition as Reshape →
Transpose → Reshape, and their reverse after attention; each step is a copy in torch. Every one of
them moves whole rows of C channels, so the chain is one gather of rows, and one copy does it:

    x [B, H, W, C] → Slice/Concat (roll) → Pad (by 0) → Reshape → Transpose → Reshape → y [B·nW, 49, C]
        ⇒  y = RowGather(x, table)   (table: 3136 rows of one image, in window order)

The chain is the largest connected set of Reshape, Transpose, Slice, Concat, Squeeze, Unsqueeze,
Flatten, Identity and Pad nodes on device values that reads one value x and is read (other than by
Shape) through one value y. What it does is found by running it: at batch 1, 2 and 3 (batch_runs.py),
x is replaced by its elements' numbers and the chain's own ops move them. It fires when y's every
row is an x row of C channels in order, the table at batch 2 and 3 is that of batch 1 repeated per
image (the batch may be folded into the rows, as Swin's windows are, but images never mix), y's
shape grows with the batch in one axis, and every Pad pads by 0. A chain that moves the last axis,
mixes images, or pads, stays. A chain that leaves the rows as they are becomes a Reshape (or
nothing); a lone Transpose or Slice stays (a view its reader may take as it is).

Values the chain made that Shape nodes read become functions of the batch (batch_runs.py); then
fold_constants folds what that leaves constant.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..ir import Graph, Node
from ..ops import default_registry
from ..ops.util import tensor_from_numpy
from .batch_runs import BatchRuns, rewrite_shape_reads, run_batches, shape_reads_follow_batch
from .eliminate_dead_nodes import eliminate_dead_nodes
from .fold_constants import fold_constants

MOVES = {"Reshape", "Transpose", "Slice", "Concat", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Pad"}
VIEWS = {"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"}  # free in torch on contiguous data
LONE_VIEWS = {"Transpose", "Slice"}  # alone, a strided view: left for its reader


@dataclass
class Chain:
    source: str  # x
    nodes: list  # in graph order
    output: str  # y


@dataclass
class Rows:
    """What a chain does to rows, per image: y's rows are x's rows `table` of each image."""
    table: np.ndarray
    rows_in: int
    shape: list  # y's shape for one image
    batch_axis: int

    def identity(self) -> bool:
        return len(self.table) == self.rows_in and np.array_equal(self.table, np.arange(self.rows_in))


def _data_inputs(node: Node) -> list[str]:
    return node.present_inputs() if node.op_type == "Concat" else node.inputs[:1]


def _is_move(node: Node, runs: BatchRuns) -> bool:
    return node.op_type in MOVES and all(runs.on_device(name) for name in _data_inputs(node))


def _exits(graph: Graph, nodes: list, consumers: dict) -> set[str]:
    """Values the chain makes that something outside it reads (Shape aside) or the graph outputs."""
    inside = {id(node) for node in nodes}
    outputs = graph.output_names()
    return {out for node in nodes for out in node.outputs if out and (out in outputs or any(
        id(user) not in inside and user.op_type != "Shape" for user in consumers.get(out, [])))}


def _ancestors(nodes: list, value: str, producers: dict) -> list:
    """The chain's nodes `value` depends on."""
    inside = {id(node) for node in nodes}
    needed, stack = set(), [value]
    while stack:
        node = producers.get(stack.pop())
        if node is not None and id(node) in inside and id(node) not in needed:
            needed.add(id(node))
            stack.extend(_data_inputs(node))
    return [node for node in nodes if id(node) in needed]


def _one_exit(graph: Graph, nodes: list, consumers: dict, producers: dict) -> tuple[list, str | None]:
    """The chain shrunk to the nodes every exit depends on until one value leaves it."""
    while nodes:
        exits = _exits(graph, nodes, consumers)
        if len(exits) == 1:
            output = exits.pop()
            return _ancestors(nodes, output, producers), output
        if not exits:
            return [], None
        needed = [{id(node) for node in _ancestors(nodes, value, producers)} for value in exits]
        common = [node for node in nodes if all(id(node) in ids for ids in needed)]
        if len(common) == len(nodes):
            return [], None
        nodes = common
    return [], None


def find_chains(graph: Graph, runs: BatchRuns) -> list[Chain]:
    """Each value read by a data-movement node it was not made by, with the chain growing from it."""
    producers, consumers = graph.producers(), graph.consumers()
    moves = [node for node in graph.nodes if _is_move(node, runs)]
    made_by_move = {out for node in moves for out in node.outputs}
    sources = dict.fromkeys(name for node in moves for name in _data_inputs(node) if name not in made_by_move)
    chains = []
    for source in sources:
        reached, nodes = {source}, []
        for node in moves:
            if all(name in reached for name in _data_inputs(node)):
                nodes.append(node)
                reached.update(out for out in node.outputs if out)
        nodes, output = _one_exit(graph, nodes, consumers, producers)
        if output is not None:
            chains.append(Chain(source, nodes, output))
    return chains


def _numbered(shape: tuple) -> torch.Tensor:
    """Each element's number from 1 (0 would be a pad's), exact in float64 and movable by every op."""
    return torch.arange(1, int(np.prod(shape)) + 1, dtype=torch.float64).reshape(shape)


def _argument(name: str, run: dict, graph: Graph, moved: dict):
    if not name:
        return None
    if name in moved:
        return moved[name]
    if name in graph.initializers:
        return tensor_from_numpy(graph.initializers[name])
    return run[name]


def _pads_zero(node: Node, args: list) -> bool:
    pads = args[1] if len(args) > 1 and args[1] is not None else node.attrs.get("pads") or []
    return not np.any(np.asarray(pads))


def _move(chain: Chain, graph: Graph, run: dict) -> torch.Tensor | None:
    """The chain run on x's element numbers; None where a Pad pads."""
    registry = default_registry()
    moved = {chain.source: _numbered(tuple(run[chain.source].shape))}
    for node in chain.nodes:
        opdef = registry[node.op_type]
        args = [_argument(name, run, graph, moved) for name in node.inputs]
        if node.op_type == "Pad" and not _pads_zero(node, args):
            return None
        result = opdef.impl(args, opdef.fill_attrs(node.attrs))
        results = result if isinstance(result, (tuple, list)) else (result,)
        moved.update((out, value) for out, value in zip(node.outputs, results) if out)
    return moved[chain.output]


def _rows_of(numbers: torch.Tensor, channels: int) -> np.ndarray | None:
    """The x row each row of y is, where every row of y is one x row's channels in order."""
    if numbers.dim() == 0 or numbers.shape[-1] != channels:
        return None
    index = numbers.reshape(-1, channels).round().to(torch.int64) - 1
    rows, lanes = index // channels, index % channels
    if (index < 0).any() or not torch.equal(lanes, torch.arange(channels).expand_as(lanes)) \
            or not torch.equal(rows, rows[:, :1].expand_as(rows)):
        return None
    return rows[:, 0].numpy()


def _batch_axis(shapes: list[tuple], batches: tuple) -> int | None:
    """The one axis of y that grows with the batch (as batch × its size at batch 1)."""
    if not all(len(shape) == len(shapes[0]) for shape in shapes):
        return None
    growing = [axis for axis in range(len(shapes[0])) if any(s[axis] != shapes[0][axis] for s in shapes)]
    if len(growing) != 1:
        return None
    axis = growing[0]
    per_image = shapes[0][axis] // batches[0]
    return axis if all(s[axis] == per_image * b for s, b in zip(shapes, batches)) else None


def rows_of_chain(chain: Chain, graph: Graph, runs: BatchRuns) -> Rows | None:
    """What the chain does to rows, the same for every image at every batch; None where it is not a
    gather of rows."""
    channels = runs.values[0][chain.source].shape[-1] if runs.values[0][chain.source].dim() else 0
    tables = []
    for run in runs.values:
        numbers = _move(chain, graph, run)
        rows = None if numbers is None else _rows_of(numbers, channels)
        if rows is None:
            return None
        tables.append(rows)
    in_shapes, out_shapes = runs.shapes(chain.source), runs.shapes(chain.output)
    if not runs.dynamic:
        return Rows(tables[0], int(np.prod(in_shapes[0][:-1])), list(out_shapes[0]), 0)
    # Per image: the rows of the first run (batch 1), which every other run must repeat image by image.
    images = runs.batches[0]
    rows_in = [int(np.prod(shape[:-1])) for shape in in_shapes]
    batch_axis = _batch_axis(out_shapes, runs.batches)
    if batch_axis is None or rows_in[0] % images or len(tables[0]) % images:
        return None
    per_image = rows_in[0] // images
    first = tables[0][:len(tables[0]) // images]
    for table, batch, count in zip(tables, runs.batches, rows_in):
        expected = np.concatenate([first + image * per_image for image in range(batch)])
        if count != batch * per_image or not np.array_equal(table, expected):
            return None
    shape = list(out_shapes[0])
    shape[batch_axis] //= images
    return Rows(first.astype(np.int64), per_image, shape, batch_axis)


def _worth_it(chain: Chain, rows: Rows) -> bool:
    """Whether replacing the chain saves a copy (views alone cost nothing)."""
    ops = {node.op_type for node in chain.nodes}
    if rows.identity():
        return not ops <= VIEWS
    return len(chain.nodes) > 1 or not ops <= LONE_VIEWS | VIEWS


def _replacement(graph: Graph, chain: Chain, rows: Rows, runs: BatchRuns) -> list[Node]:
    """The nodes that compute y from x: nothing, a Reshape, or a RowGather (with its table)."""
    last = chain.nodes[-1]
    origin = [name for node in chain.nodes for name in node.origin]
    if rows.identity() and runs.shapes(chain.source) == runs.shapes(chain.output):
        return []
    if rows.identity():
        target = list(rows.shape)
        target[rows.batch_axis] = -1
        shape_name = graph.fresh_name(chain.output + "_shape")
        graph.initializers[shape_name] = np.asarray(target, dtype=np.int64)
        return [Node("Reshape", graph.fresh_name(last.name + "_view"), [chain.source, shape_name], [chain.output],
                     origin=origin)]
    table = graph.fresh_name(chain.output + "_rows")
    graph.initializers[table] = rows.table
    return [Node("RowGather", graph.fresh_name(last.name + "_rows"), [chain.source, table], [chain.output],
                 attrs={"rows_in": rows.rows_in, "shape": rows.shape, "batch_axis": rows.batch_axis},
                 origin=origin)]


def _replace(graph: Graph, chain: Chain, rows: Rows, runs: BatchRuns) -> None:
    removed = {out for node in chain.nodes for out in node.outputs if out}
    new_nodes = _replacement(graph, chain, rows, runs)
    at = graph.nodes.index(chain.nodes[-1])
    graph.nodes[at:at + 1] = new_nodes
    for node in chain.nodes[:-1]:
        graph.nodes.remove(node)
    if not new_nodes:  # y is x: its readers read x
        removed.discard(chain.output)
        graph.replace_uses(chain.output, chain.source)
    rewrite_shape_reads(graph, runs, removed - {chain.output})


def _removable(graph: Graph, chain: Chain, runs: BatchRuns) -> bool:
    """Whether the values the chain made, y aside, are read by the chain and by Shape nodes only,
    those computable from the batch."""
    inside = {id(node) for node in chain.nodes}
    removed = {out for node in chain.nodes for out in node.outputs if out} - {chain.output}
    consumers = graph.consumers()
    if any(id(user) not in inside and user.op_type != "Shape" for name in removed for user in consumers.get(name, [])):
        return False
    return not removed & graph.output_names() and shape_reads_follow_batch(graph, runs, removed)


def _may_hold_chains(graph: Graph) -> bool:
    """Whether some op that copies in torch may move a tensor of rows (rank 2 or more, or unknown):
    the graph is run only then (shape arithmetic moves vectors)."""
    for node in graph.nodes:
        if node.op_type in MOVES - VIEWS and node.inputs and not graph.is_constant(node.inputs[0]):
            shape = graph.shape_of(node.inputs[0])
            if shape is None or len(shape) >= 2:
                return True
    return False


def gather_rows(graph: Graph) -> int:
    if not _may_hold_chains(graph):
        return 0
    runs = run_batches(graph)
    if runs is None:
        return 0
    fired = 0
    for chain in find_chains(graph, runs):
        rows = rows_of_chain(chain, graph, runs)
        if rows is None or not _worth_it(chain, rows) or not _removable(graph, chain, runs):
            continue
        if rows.identity() and chain.output in graph.output_names() \
                and runs.shapes(chain.source) == runs.shapes(chain.output):
            continue  # a graph output keeps a producer
        _replace(graph, chain, rows, runs)
        fired += 1
    if fired:
        fold_constants(graph)
        eliminate_dead_nodes(graph)
    return fired
