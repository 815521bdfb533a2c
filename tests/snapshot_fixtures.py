"""The allocator snapshots under ``fixtures/snapshots/`` by name: ``path`` and ``raw`` (the capture unpickled as
it is), for snapshots/test_snapshots.py and oom/test_oom_operation.py."""
import gzip
import os
import pickle

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "snapshots")


def path(name):
    return os.path.join(HERE, name + ".pickle.gz")


def raw(name):
    with gzip.open(path(name), "rb") as fh:
        return pickle.load(fh)  # our own fixture; the library's loader is what the tests test
