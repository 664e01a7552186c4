"""Every check in csrc/ is an EL_CHECK, whose message never streams a number through std::ostream.

On the lent H100 machine (torch 2.11, its /opt/gcc/bin/g++), an extension that streams an integer into an
ostringstream crashes with SIGSEGV (session 10: a plain ``ss << int64_t(5)`` in a load_inline extension, and
every TORCH_CHECK of ours that named a size). ``EL_CHECK`` (csrc/ops.h) builds its message with
``elasticlab::message``, which writes integers and floats with std::to_string and shapes as "[2, 3]"; so a
new check needs no care, provided it is an EL_CHECK. This test holds csrc/ to that; the messages themselves
are checked where the kernels' errors are (tests/gns/test_kernels.py and the others match their text)."""
from __future__ import annotations

import pathlib
import re

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"
RAW = re.compile(r"\b(TORCH_CHECK|TORCH_INTERNAL_ASSERT|AT_ASSERT|AT_ERROR)\s*\(|"
                 r"std::(o|)stringstream|std::c(out|err)")


def raw_checks(src: str) -> list[str]:
    """Lines of ``src`` (comments dropped) that check or build a message other than through EL_CHECK."""
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", src, flags=re.S)
    return [line.strip() for line in code.splitlines() if RAW.search(line)]


def test_the_scan_finds_a_raw_check():
    assert raw_checks('TORCH_CHECK(x.dim() == 2, "got ", x.sizes());\n// TORCH_CHECK in a comment') == \
        ['TORCH_CHECK(x.dim() == 2, "got ", x.sizes());']
    assert raw_checks('std::ostringstream ss; ss << n;') == ['std::ostringstream ss; ss << n;']
    assert raw_checks('kernel<<<grid, 256>>>(x, int64_t(1) << 20);') == []
    assert raw_checks('EL_CHECK(x.dim() == 2, "got ", x.sizes(), " of ", x.size(0));') == []


def test_every_check_in_csrc_is_an_el_check():
    files = sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".cu", ".h", ".cuh"))
    assert files
    ops = (CSRC / "ops.h").read_text()
    assert "#define EL_CHECK(cond, ...) TORCH_CHECK(cond, ::elasticlab::message(__VA_ARGS__))" in ops
    bad = {str(p.relative_to(CSRC)): b for p in files
           if p.name != "ops.h" and (b := raw_checks(p.read_text()))}
    assert not bad, f"use EL_CHECK (csrc/ops.h) for these: {bad}"
