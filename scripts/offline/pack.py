"""Packs a GPU machine's results into as few .tgz archives as a transfer channel with a file-size limit allows
(scripts/offline/run.sh pack; docs/offline-gpu.md).

    python3 pack.py OUT ROOT PATH... [--max-mb 15] [--prefix pack]

Each PATH (relative to ROOT) goes whole into one archive; archives are filled first-fit in the order
given, each at most --max-mb MiB. A path larger than the limit alone (a 4-layer drafter's export) gets an
archive of its own, split in parts under the limit: `<prefix>N.tgz.0`, `.1`, ...; on the other side,
`cat <prefix>N.tgz.* | tar xz` joins them (the parts in numeric order: `ls -v`, past ten parts).
Standard library only: it runs with the machine's own python3.
"""

from __future__ import annotations

import argparse
import tarfile
from pathlib import Path


def size_mb(p: Path) -> float:
    return sum(f.stat().st_size for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("root")
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--max-mb", type=float, default=15.0)
    ap.add_argument("--prefix", default="pack")
    a = ap.parse_args()
    root = Path(a.root)
    bins: list[tuple[float, list[str]]] = []
    big: list[str] = []
    for rel in a.paths:
        mb = size_mb(root / rel)
        if mb > a.max_mb:
            big.append(rel)
            continue
        for i, (used, items) in enumerate(bins):
            if used + mb <= a.max_mb:
                bins[i] = (used + mb, items + [rel])
                break
        else:
            bins.append((mb, [rel]))
    for i, (used, items) in enumerate(bins):
        name = Path(a.out) / f"{a.prefix}{i}.tgz"
        with tarfile.open(name, "w:gz", compresslevel=1) as tar:
            for rel in items:
                tar.add(root / rel, arcname=rel)
        print(f"{name.name}: {used:.1f} MiB: {' '.join(items)}")
    for j, rel in enumerate(big, start=len(bins)):
        name = Path(a.out) / f"{a.prefix}{j}.tgz"
        with tarfile.open(name, "w:gz", compresslevel=1) as tar:
            tar.add(root / rel, arcname=rel)
        data, step = name.read_bytes(), int(a.max_mb * 2**20)
        name.unlink()
        for k in range(0, len(data), step):
            Path(f"{name}.{k // step}").write_bytes(data[k : k + step])
        print(f"{name.name}.0..{(len(data) - 1) // step}: {len(data) / 2**20:.1f} MiB in parts: {rel}")


if __name__ == "__main__":
    main()
