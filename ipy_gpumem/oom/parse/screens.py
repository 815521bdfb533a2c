"""Screens for long text: where a message may be, found without reading the text closely.

Each is a literal searched for from the end with str.rfind (0.1-0.6 ms per MiB), and for some a regex
that checks the words around it. They run on a lower-cased copy of the raw text in which newlines,
tabs and carriage returns are spaces, so a hard-wrapped message still reads "out of memory". They
check about as much as the anchors do, so that a megabyte of near misses ("xcuda out of memory")
cannot use up the candidates read per text (``search._WINDOWS``), and they are grouped by rank, so
that a log full of one family's lines never stops the search for a richer family further up.

Every family has a screen. What no screen finds is a message spelled with other than single spaces
between its words (or none), split inside a word, or with markup inside it; the text is read in full
where those copies come from: all of it up to 32 KiB (128 KiB with little markup), and the last
16 KiB of longer text. A screen that ``needs`` a word is skipped, after one substring test, in text
without it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .clean import lower_same_length

_SCREEN_CHUNK = 64 * 1024
_SCREEN_OVERLAP = 2048  # longer than any screen match (a MapAllocator file name may take 1000)


@dataclass(frozen=True)
class _ScreenDef:
    literal: str
    check: Optional[re.Pattern[str]] = None  # starts with the literal; None: the literal is enough
    # The same check for the reversed text, so that a run of occurrences that the check rejects (a
    # megabyte of "error: out of memory" for the rank-0 screen) costs one regex search, not a Python
    # call per occurrence.
    reverse: Optional[re.Pattern[str]] = None
    # Or the check split by the words before the literal: each alternative starts with a literal of its
    # own, and one that is not "memoryerror" skips a megabyte of inline "MemoryError" in no time.
    spelled: Tuple[re.Pattern[str], ...] = ()
    lines: bool = False  # search the lower-cased copy that keeps its newlines
    needs: Tuple[str, ...] = ()  # skip unless the text holds one of these (one cheap test, many screens)
    # Skip unless the text holds each of the literal's characters. A one-character test is a memchr
    # (0.01 ms per MiB), while searching a megabyte made of the literal's own letters ("ooo...") for
    # the literal takes up to 0.6 ms, for each screen.
    chars: Tuple[str, ...] = ()


def _screen(literal: str, check: Optional[str] = None, reverse: Optional[str] = None,
            spelled: Tuple[str, ...] = (), lines: bool = False, needs: Tuple[str, ...] = ()) -> _ScreenDef:
    return _ScreenDef(literal, None if check is None else re.compile(check, re.ASCII),
                      None if reverse is None else re.compile(reverse, re.ASCII),
                      tuple(re.compile(source, re.ASCII) for source in spelled), lines, needs,
                      tuple(sorted(set(literal))))


_MEM = ("memory",)
_ALLOC = ("alloc",)


def _after(words: Tuple[str, ...], literal: str) -> str:
    """Lookbehinds: ``literal`` right after one of ``words``; a final colon in one is spelled ": ", ":"
    or " : ", the spacings seen in real messages."""
    spelled = [w[:-1] + sep if w.endswith(":") else w for w in words
               for sep in ((": ", ":", " : ") if w.endswith(":") else ("",))]
    return "|".join(f"(?<={re.escape(w + literal)})" for w in spelled)


_SCREENS: Tuple[Tuple[_ScreenDef, ...], ...] = (
    (  # rank 0
        # "CUDA out of memory" and the other allocators (not "xcuda out of memory"), MPS, ggml's
        # "cudaMalloc failed: out of memory", ONNX Runtime's "CUDA failure 2: out of memory", spconv's
        # "cuda failed with error 2 out of memory", XLA's "RESOURCE_EXHAUSTED: Out of memory".
        _screen(
            "out of memory",
            r"out of memory(?:" + "|".join(
                rf"(?<={dev} out of memory)(?<![a-z]{dev} out of memory)"
                for dev in ("cuda", "hip", "xpu", "npu", "mlu", "musa"))
            + "|" + _after(("mps backend ", "cudamalloc failed:", "failure 2:", "with error 2 ", "with error 2:",
                            "resource exhausted:", "resource_exhausted:"), "out of memory") + ")",
            r"yromem fo tuo(?: (?:(?:aduc|pih|upx|upn|ulm|asum)(?![a-z])|dnekcab spm|2 rorre htiw)"
            r"|(?: :| : |:)(?:deliaf collamaduc|2 eruliaf|2 rorre htiw|detsuahxe[ _]ecruoser))",
            needs=_MEM,
        ),
        _screen("out of memory allocating", r"out of memory allocating [0-9]", needs=_MEM),  # CuPy
        _screen("allocation on device", r"allocation on device (?:[0-9]+ )?would exceed allowed memory",
                needs=_MEM),  # cudaMallocAsync
        _screen("allocator (", r"allocator \([^)]{1,40}\) ran out of memory", needs=_MEM),  # TensorFlow's BFC
        _screen("cuda error 2 at", r"cuda error 2 at [^ ]{1,200}? ?: ?out of memory", needs=_MEM),  # ggml
        _screen("cumem", r"cumem[a-z_0-9]{0,20} ?failed ?: ?out of memory", needs=_MEM),  # the driver API
        _screen("defaultcpuallocator", r"defaultcpuallocator ?: ?(?:can.?t allocate memory|not enough memory)"),
        _screen("not enough memory", r"not enough memory(?:" + _after(("torch:",), "not enough memory") + ")",
                needs=_MEM),  # TH
        _screen("unable to ", r"unable to (?:allocate (?:[0-9][0-9.]* ?[a-z]{0,5} for an )?array"
                r"|mmap [0-9]+ bytes from file <[^<>]{0,1000}> ?: ?cannot allocate memory)"),  # numpy, MapAllocator
        _screen("oom when allocating", needs=_ALLOC),  # TensorFlow, also behind "Resource exhausted: OOM"
        _screen("failed to alloc", r"failed to alloc(?:ate)? (?:[0-9][0-9.]* ?[a-z]{0,5} (?:on |\([0-9]+ bytes\) from)"
                r"|request for|memory for requested|memory(?<=: failed to allocate memory))", needs=_ALLOC),
        _screen("nccl warn ", r"nccl warn (?:cuda failure (?:[0-9]+ )?[^ ]{0,6}out of memory|failed to cuda calloc)",
                needs=_MEM + _ALLOC),
        _screen("could not allocate tensor with", r"could not allocate tensor with [0-9]", needs=_ALLOC),  # DirectML
        _screen("curesult error", r"curesult error(?: result ?=| ?:) ?2(?![0-9])"),  # torch_memory_saver
    ),
    (  # rank 1
        # An allocator message without its first sentence.
        _screen("has a total capac", r"has a total capaci?ty of [0-9][0-9.]* ?[a-z]{0,5} of which"),
        _screen("(gpu ", r"\(gpu [0-9]+ ?; ?[0-9][0-9.]* ?[a-z]{0,5} total capacity"),
        _screen("(npu ", r"\(npu [0-9]+ ?; ?[0-9][0-9.]* ?[a-z]{0,5} total capacity"),
        # "CUDA error: out of memory" (HIP, the driver API), THC's "cuda runtime error (2) : out of
        # memory" and "THCudaCheck FAIL ... error=2 : out of memory".
        _screen(
            "out of memory",
            r"out of memory(?:" + _after(("cuda error:", "hip error:", "driver error:", "(2):", "error=2:",
                                          "error = 2:"), "out of memory") + ")",
            r"yromem fo tuo(?: :| : |:)(?:rorre (?:aduc|pih|revird)|\)2\( rorre emitnur|2=rorre|2 = rorre)",
            needs=_MEM,
        ),
        _screen("out of memory: kill", r"out of memory: kill(?:ed)? process [0-9]", needs=_MEM),  # the OOM killer
        _screen("allocate memory", r"allocate memory(?:" + _after(("errno 12] cannot ", "errno 12]cannot "),
                                                                 "allocate memory") + ")", needs=_MEM),
        # cuBLAS, hipBLAS, cuDNN, cuSOLVER, cuSPARSE, cuRAND, cuFFT.
        _screen("alloc_failed", r"alloc_failed(?:(?<=status_alloc_failed)|(?<=cufft_alloc_failed))", needs=_ALLOC),
        _screen("statusallocfailed", needs=_ALLOC),  # MIOpen
        _screen("status_not_enough_memory", needs=_MEM),  # cuDNN
        _screen("posix_memalign(", r"posix_memalign\(&data, ?galignment, ?nbytes\) ?== ?0\. ?12 vs 0"),  # torch < 1.2
        _screen("error_out_of_", r"error_out_of_(?:(?<=ur_result_error_out_of_)(?:device|host)_memory"
                r"|(?<=pi_error_out_of_)host_memory|(?<=ze_result_error_out_of_)(?:device|host)_memory)"),  # Intel
    ),
    (  # rank 2
        _screen("std::bad_alloc", needs=_ALLOC),
        _screen("cuda_error_out_of_memory", needs=_MEM),
        _screen("cudaerrormemoryallocation", needs=_MEM),
        _screen("hiperroroutofmemory", needs=_MEM),
        # An exception line: at a line's start, or after the indentation of a code block or a quote.
        _screen("memoryerror",
                r"memoryerror(?:(?<![^\n]memoryerror)|(?<=\n    memoryerror)|(?<=\n> memoryerror)"
                r"|(?<=\nbuiltins\.memoryerror))(?: ?:|\(\)|[ \t\r]*(?:\n|\Z))",
                spelled=tuple(re.escape(line_start) + r"memoryerror(?: ?:|\(\)|[ \t\r]*(?:\n|\Z))"
                              for line_start in ("\n", "\n    ", "\n> ", "\nbuiltins.")),
                lines=True, needs=_MEM),
    ),
    (  # rank 3
        _screen("dataloader worker", r"dataloader worker (?:\(pid [0-9]+\) )?is killed by signal ?: ?killed"),
        _screen("valid cudnn algorithm to run convolution"),
        _screen("blas_status_not_initialized"),
        _screen("error_out_of_resources", r"error_out_of_resources(?:(?<=ur_result_error_out_of_resources)"
                r"|(?<=pi_error_out_of_resources))"),
    ),
)
_SKELETON = str.maketrans({**{c: c.lower() for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ"},
                           "\n": " ", "\r": " ", "\t": " ", "\x0b": " ", "\x0c": " "})
_NEAR_MISSES = 16  # occurrences a check may reject one by one before a regex takes over


class ScreenSearch:
    """Candidates in ``raw[:end]``, searched from the end; what each screen found is kept, since the
    search only ever moves towards the start. Once one screen of a rank has a candidate, the others
    only search the text after it (their floor), where they could still beat it."""

    def __init__(self, raw: str, end: int):
        self.raw = raw
        self.end = end
        self._texts: Dict[Tuple[bool, bool], str] = {}
        self._has: Dict[Tuple[str, bool], bool] = {}
        # screen -> (its last match below the ``hi`` asked for, or None for none at or above ``floor``)
        self._last: Dict[_ScreenDef, Tuple[Optional[Tuple[int, int]], int]] = {}

    def _text(self, lines: bool, reverse: bool = False) -> str:
        text = self._texts.get((lines, reverse))
        if text is None:
            if reverse:
                text = self._text(lines)[::-1]
            elif lines:
                text = lower_same_length(self.raw[: self.end])
            else:
                part = self.raw[: self.end]
                if part.isascii():  # one pass: translate has a fast path for ASCII, and only for it
                    text = part.translate(_SKELETON)
                else:
                    text = self._text(True).replace("\n", " ").replace("\r", " ").replace("\t", " ")
            self._texts[(lines, reverse)] = text
        return text

    def last(self, rank: int, hi: int) -> Optional[Tuple[int, int]]:
        """The last candidate of ``rank`` starting before ``hi``, as (start, end)."""
        best = None
        for screen in _SCREENS[rank]:
            hit = self._last_of(screen, hi, 0 if best is None else best[0] + 1)
            if hit is not None and hit[0] < hi and (best is None or hit[0] > best[0]):
                best = hit
        return best

    def _holds(self, needle: str, lines: bool) -> bool:
        key = (needle, lines)
        if key not in self._has:
            # Its letters first: a missing one is found at memchr speed, the word itself can take 2 ms
            # in a megabyte made of its other letters.
            self._has[key] = all(self._holds(c, lines) for c in set(needle)) if len(needle) > 1 else True
            self._has[key] = self._has[key] and needle in self._text(lines)
        return self._has[key]

    def _needed(self, screen: _ScreenDef) -> bool:
        if not all(self._holds(char, screen.lines) for char in screen.chars):
            return False
        return not screen.needs or any(self._holds(needle, False) for needle in screen.needs)

    def _last_of(self, screen: _ScreenDef, hi: int, floor: int) -> Optional[Tuple[int, int]]:
        """The screen's last match starting before ``hi``; None if there is none at or above ``floor``."""
        if screen in self._last:
            known, known_floor = self._last[screen]
            if known is not None and known[0] < hi:
                return known
            if known is None and known_floor <= floor:
                return None
        found = None
        if self._needed(screen):
            text = self._text(screen.lines)
            literal, check = screen.literal, screen.check
            end = min(len(text), hi - 1 + len(literal))  # an occurrence must start before hi
            for _ in range(_NEAR_MISSES):
                pos = text.rfind(literal, floor, end)
                if pos < 0:
                    break
                m = None if check is None else check.match(text, pos)
                if check is None or m is not None:
                    found = (pos, pos + len(literal) if m is None else m.end())
                    break
                end = pos + len(literal) - 1
            else:  # a run of near misses: let the regex engine reject the rest
                found = self._scan_back(screen, text, end - len(literal) + 1, floor)
        self._last[screen] = (found, floor)
        return found

    def _scan_back(self, screen: _ScreenDef, text: str, stop: int, floor: int) -> Optional[Tuple[int, int]]:
        """The last match of the screen's check starting in [floor, stop)."""
        if screen.spelled:
            hits = [hit for hit in (self._scan_forward(rx, text, stop, floor) for rx in screen.spelled) if hit]
            return max(hits) if hits else None
        if screen.reverse is not None:
            rev = self._text(screen.lines, reverse=True)
            # In the reversed text the check reads the words before the literal; its first match from
            # where ``stop`` lands is the last one before ``stop``.
            m = screen.reverse.search(rev, len(text) - stop - len(screen.literal) + 1, len(text) - floor)
            if m is None:
                return None
            return len(text) - m.start() - len(screen.literal), len(text) - m.start()
        assert screen.check is not None
        return self._scan_forward(screen.check, text, stop, floor)

    @staticmethod
    def _scan_forward(rx: re.Pattern[str], text: str, stop: int, floor: int = 0) -> Optional[Tuple[int, int]]:
        """The last match of ``rx`` starting in [floor, stop), read forwards a chunk at a time from the end."""
        while stop > floor:
            lo = max(floor, stop - _SCREEN_CHUNK)
            last = None
            for m in rx.finditer(text, lo, min(len(text), stop + _SCREEN_OVERLAP)):
                if m.start() >= stop:
                    break
                last = m
            if last is not None:
                return last.start(), last.end()
            stop = lo
        return None
