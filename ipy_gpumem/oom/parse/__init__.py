"""Find an out-of-memory message in any pasted error text and read its numbers into an ``OomReport``.

Covers every PyTorch allocator generation (CUDA, HIP, XPU, MPS, CPU), the CUDA runtime, cuBLAS and cuDNN
errors, TensorFlow/XLA, and a few neighbouring runtimes (NCCL, ggml, spconv, DirectML, ONNX Runtime).
Errors that are out-of-memory errors in disguise in most public reports (a DataLoader worker killed by
the kernel, cuDNN finding no usable algorithm, a cuBLAS handle that cannot be created) are reported too,
with ``confidence`` saying how sure that reading is; they never hide a message that says it ran out of
memory.

One module per step, so that each can be read (and timed) on its own; in the order a text meets them:

    search      ``parse_oom``: how much of the text is read closely, and where (speed lives here)
    clean       undoing what renderers, terminals and issue trackers did to the text
    screens     in long text, where a message may be, found without reading the text closely
    read        the best anchor in cleaned text, where its message ends, its exception type
    detectors   one anchor per message shape, with its family, rank and finder
    formats     each family's field parser: which numbers its message prints, and how
    numbers     the regex building blocks for sizes and integers, and the window they are read from
    report      :class:`OomReport` and the names its fields take
"""
from .report import CONFIDENCES, KINDS, SIZE_FIELDS, OomReport
from .search import parse_oom

__all__ = ["CONFIDENCES", "KINDS", "SIZE_FIELDS", "OomReport", "parse_oom"]
