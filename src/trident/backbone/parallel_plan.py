"""Parallel plans as data: how a kind of module is split over the ranks of a tensor-parallel group.

A module that can be split declares ``parallel_plan(self) -> ParallelPlan``: a mapping from the dotted path of
each of its submodules (``""``: the module itself) to how that submodule is split. A module that declares
nothing stays whole on every rank of a group (norms, the MLM's transform, patch embeddings, classifier heads).
The mechanics that carry a plan out (row orders, hooks, tied weights, gradient clipping, the heads' dropout
streams) are in one place, :mod:`trident.parallel.tensor_parallel`; these classes hold no torch.distributed
state, so declaring a plan costs a module nothing until a run asks for tensor parallelism.

Each network walks its own modules: a module declares the splits of its direct parts only (an attention module
its projections, a language model its embedding and head), and the walk finds every block.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Columns:
    """A linear layer's output features split over the ranks: each rank computes its share from the whole input.

    ``parts``: the row counts of a fused projection's parts one after the other ([q; k; v], [gate; value]); each
    part is split on its own, so every rank holds its share of each (an even split of the fused rows would hand
    rank 0 all the queries, or swiglu's whole gate). Empty: one part. ``gather``: the output is gathered whole
    over the ranks (a vocabulary head, whose logits the loss reads whole)."""

    parts: tuple[int, ...] = ()
    gather: bool = False


@dataclass(frozen=True)
class Rows:
    """A linear layer's input features split over the ranks: each rank's partial sum is added over them (one
    all-reduce). ``whole_input``: an embedding table split by rows, looked up with ids every rank holds whole
    (each rank looks up the ids it holds)."""

    whole_input: bool = False


@dataclass(frozen=True)
class Heads:
    """An attention module whose projections split its heads: the module computes its rank's share of the heads
    (its local head counts come from the plan, its configured counts stay as built), draws their dropout masks
    from the rank's own random stream, and returns every head's attention weights (gathered over the ranks)."""


Split = Columns | Rows | Heads
# Submodule path (dotted, relative to the declaring module; "" for itself) -> how it is split.
ParallelPlan = Mapping[str, Split]

# A language model's embedding and vocabulary head (the LM's, the MLM's): the table split by rows, the head by its
# columns and its logits gathered whole. A tied matrix stays one parameter: both split its dim 0 alike.
VOCABULARY_PLAN: ParallelPlan = {"embed": Rows(whole_input=True), "head": Columns(gather=True)}
