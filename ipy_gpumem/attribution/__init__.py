"""Who holds the memory: every tensor byte in the user's namespace attributed to a category and a typed holder.

    who.py          who() and WhoReport
    holders.py      Holder rows (kind, roots, expr, frame, keys) and IPython's own references, by identity
    claims.py       the categories and the claim that each storage's holders make for it
    walk.py         the breadth-first walk over the namespace, IPython's caches and the last error, on a budget
    graphs.py       its autograd half: what the graphs of the tensors it found keep alive
    view.py         %gpumem who and the OOM panel's "who holds it" section

Importing this package imports none of them: the extension loads them when first used. (The room
is not called ``who``: importing a submodule of ``ipy_gpumem.who`` would replace the public
function ``ipy_gpumem.who()`` with the package.)
"""
