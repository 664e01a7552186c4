"""No error message in csrc/ streams a number or a shape through std::ostream.

On the lent H100 machine (torch 2.11, its /opt/gcc/bin/g++), an extension that streams an integer into an
ostringstream crashes with SIGSEGV (session 10: a plain ``ss << int64_t(5)`` in a load_inline extension, and
every TORCH_CHECK of ours that named a size). Messages therefore write numbers with ``int_str`` and shapes
with ``shape_str`` (csrc/ops.h, std::to_string). This test reads each TORCH_CHECK's message arguments and
fails on one that is a size, a shape, a dimension count or an element count left bare (a plain integer
variable it cannot tell from a string; those are wrapped by hand)."""
from __future__ import annotations

import pathlib
import re

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"
BARE = re.compile(r"(\.sizes\(\)(\.slice\([^)]*\))?|\.strides\(\)|\.size\(\w+\)|\.stride\(\w+\)|\.dim\(\)|"
                  r"\.numel\(\)|\.size\(\))$")


def _skip_string(src: str, i: int) -> int:
    """Index just past the string literal starting at src[i] == '"'."""
    j = i + 1
    while src[j] != '"':
        j += 2 if src[j] == "\\" else 1
    return j + 1


def _args(src: str, start: int) -> list[str]:
    """The top-level arguments of the call whose '(' ends just before ``start``."""
    out, cur, depth, i = [], "", 1, start
    while depth:
        ch = src[i]
        if ch == '"':
            j = _skip_string(src, i)
            cur, i = cur + src[i:j], j
            continue
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth and ch == "," and depth == 1:
            out.append(cur.strip())
            cur = ""
        elif depth:
            cur += ch
        i += 1
    return out + [cur.strip()]


def bare_numbers(src: str) -> list[str]:
    """Message arguments of the TORCH_CHECKs in ``src`` that would stream a size or shape."""
    bad = []
    for m in re.finditer(r"\bTORCH_CHECK\(", src):
        args = _args(src, m.end())
        bad += [a for a in args[1:] if BARE.search(a) and not a.startswith(("int_str(", "shape_str("))]
    return bad


def test_the_check_finds_a_bare_size():
    src = 'TORCH_CHECK(x.dim() == 2, "got shape ", x.sizes(), " of ", x.size(0), int_str(n), "(a, b)");'
    assert bare_numbers(src) == ["x.sizes()", "x.size(0)"]
    assert bare_numbers('TORCH_CHECK(ok, "got ", shape_str(x.sizes()), ", ", int_str(x.size(1)));') == []


def test_no_message_in_csrc_streams_a_size():
    files = sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".cu", ".h", ".cuh"))
    assert files
    bad = {str(p.relative_to(CSRC)): b for p in files if (b := bare_numbers(p.read_text()))}
    assert not bad, f"wrap these in int_str()/shape_str() (csrc/ops.h): {bad}"
