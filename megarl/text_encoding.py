"""Which wide Unicode encoding a text file that megarl reads as UTF-8 (recipes, JSONL data) is in.

Editors on Windows save UTF-16 by default; read as UTF-8 such a file fails on its first byte or
line, which says nothing about the cause. Callers name the encoding and the `iconv` command.
"""

# Byte-order marks, longest first (UTF-32LE's starts like UTF-16LE's); iconv's name of each encoding.
_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def wide_encoding(head: bytes) -> str | None:
    """The iconv name of the encoding of a file starting with `head` (its first 4 bytes) when it is
    UTF-16 or UTF-32: a byte-order mark, or ASCII text with every other byte 0; else None."""
    encoding = next((name for bom, name in _BOMS if head.startswith(bom)), None)
    if encoding is None and len(head) >= 2 and (head[0] == 0) != (head[1] == 0):
        encoding = "UTF-16LE" if head[1] == 0 else "UTF-16BE"
    return encoding


def iconv_hint(path, encoding: str, converted) -> str:
    """`iconv -f UTF-16 -t UTF-8 train.jsonl > train.utf8.jsonl`."""
    return f"iconv -f {encoding} -t UTF-8 {path} > {converted}"
