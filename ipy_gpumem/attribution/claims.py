"""The vocabulary of a ``who()`` walk's claims, shared by the walk and its graph half.

Each tensor storage is claimed by every holder that reaches it, and the smallest claim wins. A
claim is a plain tuple, compared as a whole, and always read by unpacking it into these names,
never by index::

    (category, priority, depth, weight, order, role, ref, nbytes, device)

``category`` is an index into :data:`CATEGORIES` (the precedence); ``priority`` puts a module
before an optimizer's parameter list before a bare Parameter; ``depth`` puts ``x`` before
``batch[0]``; ``weight`` puts the larger module first; ``order`` is the namespace order of the
holder's top-level name; ``role`` says what the holder is to the storage (below); ``ref`` is the
holder's path, or, for :data:`GRAPH`, the owners (indices of the graph roots that reach it);
``nbytes`` and ``device`` ride along for the report.
"""
from __future__ import annotations

__all__ = ["CATEGORIES", "PARAMETERS", "GRADIENTS", "OPTIMIZER", "OTHER", "GRAPHS", "CACHES",
           "VAR", "GRAD", "MODULE", "MODULE_GRADS", "OPTIM", "OPT_PARAMS", "OPT_GRADS", "GRAPH", "ROLE_KINDS"]

#: The attributed categories, highest precedence first.
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "other_tensors",
    "retained_graphs",
    "ipython_caches",
)
PARAMETERS, GRADIENTS, OPTIMIZER, OTHER, GRAPHS, CACHES = range(6)

# What a claim says about its holder: the thing at the path itself, its ``.grad``, a module's
# parameters (and their grads), an optimizer's state (params, grads), or an autograd graph.
VAR, GRAD, MODULE, MODULE_GRADS, OPTIM, OPT_PARAMS, OPT_GRADS, GRAPH = range(8)
#: The Holder kind of each role but VAR (whose kind depends on the root: variable, out_cache...) and GRAPH.
ROLE_KINDS = {GRAD: "grad", MODULE: "module", MODULE_GRADS: "module_grads", OPTIM: "optimizer",
              OPT_PARAMS: "optimizer_params", OPT_GRADS: "optimizer_grads"}
