"""YAML that Kubernetes, Helm and Prometheus read back as the strings we wrote.

PyYAML writes YAML 1.1; the readers of what Flotilla writes are Go (kubectl and the API server through
sigs.k8s.io/yaml, Helm, Prometheus), and they take more plain scalars for numbers than YAML 1.1 does:
`766e7` and `1e3` (a float without a dot), `0o17`, `1_000`, `+Inf`. PyYAML leaves such a string plain,
so a label value that happens to be `766e7` reached the API server as the number 7.66e9 and was refused.
Every manifest, chart file and config Flotilla writes goes through `dump`/`dump_all` here (a test forbids
PyYAML's own dumpers elsewhere): a string that any of those readers could take for something else is
quoted. Stdlib and PyYAML only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml

_STR_TAG = "tag:yaml.org,2002:str"


def read_as_non_string(value: str) -> bool:
    """Whether a Go YAML reader could take this plain scalar for a number (Go's ParseInt with base
    prefixes, ParseFloat with exponents, infinities and NaN; underscores dropped first, as yaml.v2 does)."""
    if not value or value[0] not in "0123456789+-.":
        return False
    plain = value.replace("_", "")
    try:
        int(plain, 0)
        return True
    except ValueError:
        pass
    try:
        float(plain)
        return True
    except ValueError:
        pass
    # Go's ParseInt(base 0) takes a leading zero as octal ("0755"); Python's int(…, 0) refuses it.
    return plain.lstrip("+-").isdigit()


class Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting every string a Go reader would not read back as that string; subclass
    it to add representers (block style for multi-line strings, say)."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and tag == _STR_TAG and read_as_non_string(value):
            return "tag:yaml.org,2002:float"  # any non-str tag: the emitter then quotes the string
        return tag


def dump(data: Any, **options: Any) -> str:
    """One YAML document, as `yaml.safe_dump` takes it (sort_keys, width, ...)."""
    return yaml.dump(data, Dumper=options.pop("Dumper", Dumper), **options)


def dump_all(documents: Iterable[Any], **options: Any) -> str:
    """Several documents separated by `---`, as `yaml.safe_dump_all` takes them."""
    return yaml.dump_all(documents, Dumper=options.pop("Dumper", Dumper), **options)
