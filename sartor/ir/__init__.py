from .graph import Graph, Node, ValueInfo, topological_order
from .verify import verify_graph

__all__ = ["Graph", "Node", "ValueInfo", "topological_order", "verify_graph"]
