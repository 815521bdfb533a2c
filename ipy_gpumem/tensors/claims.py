"""The vocabulary of a walk's claims: the one role order, the tiers, and what a holder is to the storage it reaches.

Each tensor storage is claimed by every holder that reaches it, and the smallest claim wins. A
claim is a plain tuple, compared as a whole, and always read by unpacking it into these names,
never by index::

    (tier, role, priority, depth, weight, order, relation, ref, nbytes, device)

``tier`` puts the user's own names (:data:`USER`) before what only IPython keeps (:data:`IPYTHON`:
its output cache, ``_``, the last error's frames); ``role`` is an index into
:data:`ROLE_ORDER`, the precedence every count in the package uses; ``priority`` puts a module
before an optimizer's parameter list before a bare Parameter; ``depth`` puts ``x`` before
``batch[0]``; ``weight`` puts the larger module first; ``order`` is the namespace order of the
holder's top-level name; ``relation`` says what the holder is to the storage (below); ``ref`` is
the holder's path, or, for :data:`GRAPH`, the owners (indices of the graph roots that reach it);
``nbytes`` and ``device`` ride along for the report.
"""
from __future__ import annotations

from ..core.roles import TENSOR_ROLES

__all__ = ["ROLE_ORDER", "PARAMETERS", "GRADIENTS", "OPTIMIZER", "OTHER", "ACTIVATIONS", "USER", "IPYTHON",
           "VAR", "GRAD", "MODULE", "MODULE_GRADS", "OPTIM", "OPT_PARAMS", "OPT_GRADS", "GRAPH", "RELATION_KINDS"]

#: The roles a storage can play, highest precedence first (``core.roles.TENSOR_ROLES``): a tensor
#: that is a parameter and also held by a name is a parameter; an activation the user also holds
#: is the user's tensor (backward would not free it).
ROLE_ORDER = TENSOR_ROLES
PARAMETERS, GRADIENTS, OPTIMIZER, OTHER, ACTIVATIONS = range(len(ROLE_ORDER))

#: Whose reference it is: the user's names (and what hangs off them), or only IPython's.
USER, IPYTHON = 0, 1

# What a claim says about its holder: the thing at the path itself, its ``.grad``, a module's
# parameters (and their grads), an optimizer's state (params, grads), or an autograd graph.
VAR, GRAD, MODULE, MODULE_GRADS, OPTIM, OPT_PARAMS, OPT_GRADS, GRAPH = range(8)
#: The holder kind of each relation but VAR (whose kind depends on the root: variable, out_cache...) and GRAPH.
RELATION_KINDS = {GRAD: "grad", MODULE: "module", MODULE_GRADS: "module_grads", OPTIM: "optimizer",
                  OPT_PARAMS: "optimizer_params", OPT_GRADS: "optimizer_grads"}
