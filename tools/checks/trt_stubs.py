"""Prepare the TensorRT-facing modules for mypy on a machine without TensorRT.

    pip install --no-deps --target build/tensorrt-stubs tensorrt-stubs==10.13.0.35.1
    python -m refusion.tools.checks.trt_stubs            # -> build/mypy/{stubs,src}
    mypy                                                 # with the [tool.mypy] settings of pyproject.toml

`--no-deps`: the stubs depend on tensorrt, which cannot install without a GPU. `--target`:
installed into site-packages, the stub folder `tensorrt/` (no __init__.py) would make
`import tensorrt` succeed as an empty namespace package, and code that probes for TensorRT
would think it is there. A site-packages install is still found, if that is where it is.

The stubs as published do not parse: a few parameters are named after Python keywords
(`in`), and one signature puts a parameter without a default after defaulted ones. This
copies them to build/mypy/stubs with those fixed. It also lays out build/mypy/src/refusion,
links to the source folders under their package names (setuptools maps `refusion.engines`
to engines/ and so on; mypy cannot follow that mapping from an editable install).
"""

from __future__ import annotations

import argparse
import keyword
import re
import shutil
from importlib import metadata
from pathlib import Path

STUBS_DIST = "tensorrt-stubs"
STUBS_VERSION = "10.13.0.35.1"
REPO = Path(__file__).resolve().parents[2]
STUBS_TARGET = REPO / "build" / "tensorrt-stubs"
PACKAGES = {"engines": "engines", "export": "export", "runtime": "runtime", "serve": "serve", "tools": "tools"}
_DEF = re.compile(r"^(?P<head>\s*def \w+\()(?P<params>.*)(?P<tail>\)\s*(->.*)?:.*)$")


def find_stubs() -> metadata.Distribution | None:
    """The tensorrt-stubs distribution in build/tensorrt-stubs, else wherever Python finds it, if installed."""
    local = metadata.distributions(name=STUBS_DIST, path=[str(STUBS_TARGET)])
    return next(iter(local), None) or next(iter(metadata.distributions(name=STUBS_DIST)), None)


def installed_stubs() -> list[Path]:
    """The .pyi files of the installed tensorrt-stubs distribution."""
    dist = find_stubs()
    if dist is None:
        raise SystemExit(f"{STUBS_DIST} is not installed: pip install --no-deps --target {STUBS_TARGET} "
                         f"{STUBS_DIST}=={STUBS_VERSION}")
    if dist.version != STUBS_VERSION:
        raise SystemExit(f"{STUBS_DIST} {dist.version} is installed; this script fixes {STUBS_VERSION}.")
    return [Path(str(dist.locate_file(f))) for f in dist.files or () if str(f).endswith(".pyi")]


def fix_signature(line: str) -> str:
    """Rename keyword-named parameters (`in` -> `in_`) and give a default to a parameter that
    follows defaulted ones (a syntax error as published)."""
    match = _DEF.match(line)
    if not match:
        return line
    params, fixed, defaulted, keyword_only = _split(match["params"]), [], False, False
    for param in params:
        name = param.split(":")[0].split("=")[0].strip()
        if keyword.iskeyword(name):
            param = param.replace(name, name + "_", 1)
        if name.startswith("*"):
            keyword_only = True  # after * or *args, parameters without defaults are legal
        elif "=" in param:
            defaulted = True
        elif defaulted and not keyword_only and name != "/":
            param += " = ..."
        fixed.append(param)
    return match["head"] + ", ".join(p.strip() for p in fixed) + match["tail"]


def _split(params: str) -> list[str]:
    """Split a parameter list at top-level commas (types hold brackets with commas)."""
    out, depth, current = [], 0, ""
    for ch in params:
        depth += ch in "[(" and 1 or ch in "])" and -1 or 0
        if ch == "," and depth == 0:
            out.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        out.append(current)
    return out


def write_stubs(out: Path) -> Path:
    """Fixed copies of the stubs under out/ (tensorrt/, tensorrt_bindings/)."""
    sources = installed_stubs()
    root = next(p for p in sources if p.parent.name == "tensorrt").parent.parent
    if out.exists():
        shutil.rmtree(out)
    for src in sources:
        dst = out / src.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text("\n".join(fix_signature(line) for line in src.read_text().splitlines()) + "\n")
    return out


def write_package_view(repo: Path, out: Path) -> Path:
    """out/refusion: the refusion package as installed, made of links to the source folders."""
    if out.exists():
        shutil.rmtree(out)
    package = out / "refusion"
    package.mkdir(parents=True)
    (package / "__init__.py").symlink_to(repo / "refusion" / "__init__.py")
    for name, folder in PACKAGES.items():
        (package / name).symlink_to(repo / folder, target_is_directory=True)
    return out


def main() -> None:
    repo = REPO
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=repo / "build" / "mypy", help="where stubs/ and src/ go")
    args = parser.parse_args()
    print(write_stubs(args.out / "stubs"))
    print(write_package_view(repo, args.out / "src"))


if __name__ == "__main__":
    main()
