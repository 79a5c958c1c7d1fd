"""Compare two calibration artifacts dataset by dataset (refactors must not change numbers).

    python benchmarks/compare_artifacts.py A.h5 B.h5

Prints, for every HDF5 dataset and attribute in either file, whether it is bit-identical
(values, dtype and shape), and exits 0 only when everything is (the write time and the
metadata digest, which covers it, are expected to differ and are reported but ignored).
"""

from __future__ import annotations

import sys

import h5py
import numpy as np

IGNORED_ATTRIBUTES = {"created", "created_utc", "metadata_sha256"}


def _items(path: str) -> dict[str, object]:
    items: dict[str, object] = {}
    with h5py.File(path, "r") as fh:

        def visit(name, obj):
            for key, value in obj.attrs.items():
                items[f"{name or '/'}@{key}"] = value
            if isinstance(obj, h5py.Dataset):
                items[name] = obj[()]

        visit("", fh)
        fh.visititems(visit)
    return items


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    first, second = (_items(path) for path in argv)
    differing = 0
    for name in sorted(first.keys() | second.keys()):
        if name not in first or name not in second:
            print(f"ONLY IN {'first' if name in first else 'second'}: {name}")
            differing += 1
        elif _same(first[name], second[name]):
            print(f"identical: {name}")
        elif name.rsplit("@", 1)[-1] in IGNORED_ATTRIBUTES:
            print(f"differs (expected): {name}")
        else:
            print(f"DIFFERS: {name}")
            differing += 1
    print(f"{differing} difference(s) in {len(first.keys() | second.keys())} datasets and attributes")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
