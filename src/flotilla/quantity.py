"""Amounts written as text: Kubernetes quantities, and the human byte sizes of command-line flags.

Two notations, so two functions, because one letter means two things in them: in a Kubernetes quantity
`m` is milli ("500m" CPU is half a core; "500m" bytes would be half a byte), where a person writing a
size on a command line means mega. `parse_quantity` reads Kubernetes' notation exactly (the node agent's
downward API, the operator's `kvCacheMemory`); `quantity_bytes` is a quantity that must be a size in
bytes; `parse_byte_size` reads a flag's `512MiB`, `4GB`, `4g` or `1e9` and refuses a bare `m` rather than
guess which one was meant. Both read their suffixes from the one table, SUFFIXES (stdlib only, so every
part may import it).
"""

from __future__ import annotations

import re
from fractions import Fraction

# Kubernetes' suffixes: decimal SI (n, u and m below one) and binary SI.
SUFFIXES: dict[str, Fraction] = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    **{s: Fraction(1000**i) for i, s in enumerate(["k", "M", "G", "T", "P", "E"], start=1)},
    **{s: Fraction(1024**i) for i, s in enumerate(["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"], start=1)},
}
_FRACTIONAL = ("n", "u", "m")  # below one: no size in bytes is written with them

# <signed number><suffix>, where the suffix is a binary or decimal SI one or a decimal exponent (1e3);
# `E` alone is exa, `E3` an exponent.
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<exponent>[eE][+-]?[0-9]+)|(?P<suffix>[KMGTPE]i|[numkMGTPE]))?"
)
_BYTE_SIZE = re.compile(r"\s*(?P<number>[0-9.eE+]+)\s*(?P<unit>[kKmMgG]i?)?[bB]?\s*")


def parse_quantity(quantity: str | int | float) -> Fraction:
    """A Kubernetes quantity ("500m", "16Gi", "1.5", "1e3", 2) as an exact number; ValueError otherwise."""
    match = _QUANTITY.fullmatch(str(quantity).strip())
    if match is None:
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity (examples: 500m, 2, 16Gi, 1e3)")
    value = Fraction(match["number"])
    if match["exponent"]:
        return value * Fraction(10) ** int(match["exponent"][1:])
    return value * SUFFIXES[match["suffix"] or ""]


def quantity_bytes(quantity: str | int) -> int:
    """A Kubernetes quantity that is a size ("2Gi", "500M", 1073741824) as a whole number of bytes
    (a fraction of a byte is dropped); a negative one, or one with a suffix below one (m, u, n), is not."""
    text = str(quantity).strip()
    match = _QUANTITY.fullmatch(text)
    if match is None or match["number"].startswith(("-", "+")) or match["suffix"] in _FRACTIONAL:
        hint = "; m is milli in a quantity (mega is M)" if match and match["suffix"] == "m" else ""
        raise ValueError(f"{quantity!r} is not a byte quantity (examples: 2Gi, 512Mi, 1073741824){hint}")
    return int(parse_quantity(text))


def parse_byte_size(text: str) -> int:
    """A size as people write it on a command line: '4GiB', '512MiB', '4GB', '4g', '1e9' or a plain number
    of bytes, the letters in either case (k, M, G are powers of 1000; Ki, Mi, Gi of 1024). A bare `m`
    ('512m') is refused: it is mega here and milli in a Kubernetes quantity. ValueError when not a size."""
    match = _BYTE_SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (examples: 1073741824, 512MiB, 4GiB)")
    number, unit = match["number"], match["unit"] or ""
    if unit == "m" and not text.rstrip().endswith(("b", "B")):
        raise ValueError(f"{text!r}: 'm' is milli in a Kubernetes quantity; write {number}M or {number}MiB")
    letter = unit[:1].upper()
    suffix = letter + "i" if len(unit) == 2 else "k" if letter == "K" else letter
    try:
        value = Fraction(number) * SUFFIXES[suffix]
    except ValueError:
        raise ValueError(f"{text!r} is not a size (examples: 1073741824, 512MiB, 4GiB)") from None
    if value <= 0:
        raise ValueError(f"{text!r}: the size must be positive")
    return int(value)
