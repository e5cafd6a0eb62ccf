"""ember.ir: dtypes, the primitive op set, `Graph`, its printer and the NumPy reference interpreter.

The floor everything stands on; it imports no other ember package.
"""
from .dtypes import DTYPES, DType, TensorType, as_dtype, bfloat16, bool_, float32, float64, int32, int64
from .graph import Graph, VerifyError, subgraph_of
from .kernel import CONTRACTIONS, KERNEL_KINDS, KernelSpec
from .interpreter import IMPLS, Result, evaluate, run
from .ops import OPS, OpDef, ShapeError, broadcast_shapes, conv_out_dim, normalize_axes
from .printer import format_graph, to_dot
from .world import COLLECTIVES, run_world

__all__ = [
    "DTYPES", "DType", "TensorType", "as_dtype", "bfloat16", "bool_", "float32", "float64", "int32", "int64",
    "Graph", "VerifyError", "KernelSpec", "KERNEL_KINDS", "CONTRACTIONS", "subgraph_of", "IMPLS", "Result", "evaluate", "run", "OPS", "OpDef", "ShapeError",
    "broadcast_shapes", "conv_out_dim", "normalize_axes", "format_graph", "to_dot",
    "COLLECTIVES", "run_world",
]
