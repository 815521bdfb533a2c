"""Who holds the memory: every tensor byte in the user's namespace attributed to a category and a typed holder.

    who.py          who() and WhoReport: the categories and holder rows of one walk (``tensors.walk``)
    holders.py      Holder rows (kind, roots, expr, frame, keys) and IPython's own references, by identity
    view.py         %gpumem who and the OOM panel's "who holds it" section

The counting itself (storages, roles, the walk over names, containers, objects, the user's code,
IPython's caches, the last error and autograd graphs) is the ``tensors`` room's; this room turns
it into rows a person reads. Importing this package imports none of them: the extension loads them
when first used. (The room is not called ``who``: importing a submodule of ``ipy_gpumem.who``
would replace the public function ``ipy_gpumem.who()`` with the package.)
"""
