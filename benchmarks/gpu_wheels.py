"""Wheels the GPU machine needs for benchmarks/gpu_session.sh, fetched here (that machine has no network).

1. Resolve the project with its `gpu` extra through pip (`pip install --dry-run --ignore-installed
   --report`): every distribution and version the project needs, with its requirements.
2. Drop what the GPU image already holds: torch and its CUDA stack, and every package of
   `IMAGE` (the image's package list), unless some requirement pins it exactly (`==`) or the
   image's listed version violates a requirement.
3. `pip download --no-deps --only-binary=:all:` the rest for the image's Python into `--dest`,
   and print the list and the total size (what travels with the working tree is capped at 64 MiB).

    python benchmarks/gpu_wheels.py [--dest .whl] [--python-version 3.12]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# The GPU image ('cuda'), as the device notes listed it (packages 2026-11-17; versions where a
# session's pip list showed them, 2026-11). Python 3.12.3.
IMAGE_VERSIONS = {
    "torch": "2.11.0",
    "triton": "3.6.0",
    "transformers": "5.17.0",
    "tokenizers": "0.23.2",
    "huggingface-hub": "1.33.0",
    "safetensors": "0.8.0",
    "numpy": "2.5.2",
    "accelerate": "1.15.0",
    "tiktoken": "0.14.0",
}
IMAGE = set(IMAGE_VERSIONS) | {
    "absl-py",
    "aiofiles",
    "aiohappyeyeballs",
    "aiohttp",
    "aiosignal",
    "annotated-doc",
    "anyio",
    "attrs",
    "certifi",
    "charset-normalizer",
    "click",
    "cloudpickle",
    "contourpy",
    "cycler",
    "einops",
    "filelock",
    "fonttools",
    "frozenlist",
    "fsspec",
    "h11",
    "hf-xet",
    "httpcore",
    "httpx",
    "idna",
    "iniconfig",
    "jinja2",
    "kiwisolver",
    "lxml",
    "markdown-it-py",
    "markupsafe",
    "matplotlib",
    "mdurl",
    "mpmath",
    "multidict",
    "networkx",
    "packaging",
    "pandas",
    "peft",
    "pillow",
    "pip",
    "pluggy",
    "propcache",
    "protobuf",
    "psutil",
    "pyarrow",
    "pygments",
    "pyparsing",
    "pytest",
    "pytest-timeout",
    "python-dateutil",
    "pyyaml",
    "regex",
    "requests",
    "rich",
    "setuptools",
    "shellingham",
    "six",
    "sympy",
    "tqdm",
    "typer",
    "typing-extensions",
    "urllib3",
    "xxhash",
    "yarl",
}
# Comes with the image's CUDA torch, never carried.
CUDA_STACK_PREFIXES = ("torch", "triton", "nvidia-", "cuda-")
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
)


def resolve() -> list[dict]:
    """pip's resolution of `.[gpu]` here: [{name, version, requires_dist}], the project first."""
    with tempfile.TemporaryDirectory() as d:
        report = Path(d) / "report.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--dry-run",
                "--ignore-installed",
                "-q",
                "--report",
                str(report),
                f"{ROOT}[gpu]",
            ],
            check=True,
        )
        items = json.loads(report.read_text())["install"]
    out = [
        {
            "name": canonicalize_name(it["metadata"]["name"]),
            "version": it["metadata"]["version"],
            "requires_dist": it["metadata"].get("requires_dist") or [],
        }
        for it in items
    ]
    return sorted(out, key=lambda d: d["name"] != "dppo-harness")


def specifiers(dists: list[dict], python_version: str) -> dict[str, list[Requirement]]:
    """Every requirement on each name, from the resolved distributions (markers evaluated for the
    image's Python on Linux; the project's own with its gpu extra)."""
    env = default_environment() | {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
    }
    reqs: dict[str, list[Requirement]] = {}
    for d in dists:
        extra = "gpu" if d["name"] == "dppo-harness" else ""
        for raw in d["requires_dist"]:
            r = Requirement(raw)
            if r.marker is None or r.marker.evaluate(env | {"extra": extra}):
                reqs.setdefault(canonicalize_name(r.name), []).append(r)
    return reqs


def to_carry(dists: list[dict], reqs: dict[str, list[Requirement]]) -> list[tuple[str, str, str]]:
    """(name, version, why) of each distribution the image lacks or cannot satisfy."""
    carry = []
    for d in dists:
        name, version = d["name"], d["version"]
        if name == "dppo-harness" or name.startswith(CUDA_STACK_PREFIXES):
            continue
        on = reqs.get(name, [])
        if name not in IMAGE:
            carry.append((name, version, "not in the image"))
        elif any(s.operator in ("==", "===") and "*" not in s.version for r in on for s in r.specifier):
            carry.append((name, version, "pinned exactly"))
        elif name in IMAGE_VERSIONS and not all(
            r.specifier.contains(Version(IMAGE_VERSIONS[name]), prereleases=True) for r in on
        ):
            carry.append((name, version, f"the image's {IMAGE_VERSIONS[name]} violates a requirement"))
    return carry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", default=str(ROOT / ".whl"))
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument("--dry-run", action="store_true", help="list what would be carried, download nothing")
    args = ap.parse_args(argv)
    dists = resolve()
    carry = to_carry(dists, specifiers(dists, args.python_version))
    for name, version, why in carry:
        print(f"{name}=={version}  ({why})")
    if args.dry_run:
        return 0
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        args.python_version,
        "-d",
        str(dest),
    ]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + [f"{n}=={v}" for n, v, _ in carry], check=True)
    size = sum(f.stat().st_size for f in dest.glob("*.whl"))
    print(json.dumps({"wheels": len(list(dest.glob("*.whl"))), "mib": round(size / 2**20, 1), "dest": str(dest)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
