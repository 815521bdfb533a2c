"""Who holds the memory: every tensor byte in the user's namespace attributed to a category and a typed holder.

    holders.py      Holder rows (kind, roots, expr, frame, keys) and IPython's own references, by identity
    walk.py         the breadth-first walk over the namespace, IPython's caches and the last error, on a budget
    attribution.py  who() and WhoReport
    view.py         %gpumem who and the OOM panel's "who holds it" section

Importing this package imports none of them: the extension loads them when first used.
"""
