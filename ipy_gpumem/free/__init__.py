"""``%gpumem free``: release what costs the user nothing (IPython's last error, cached outputs), never a variable.

    release.py  the plan, the release and the whole command (free_memory) as data
    view.py     what would be / was released, and the memory before and after
"""
