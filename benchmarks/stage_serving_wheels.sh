#!/usr/bin/env bash
# Download the server's Python packages that a GPU image without network may lack (fastapi,
# starlette, pydantic(-core), uvicorn) into .stage/whl, on a machine that reaches PyPI. On the GPU
# machine, before `python benchmarks/run.py serving`:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .stage/whl/*.whl
#   export PYTHONPATH=/tmp/site
# The versions are the ones this repo's tests pass with; their dependencies are listed explicitly
# (--no-deps) and checked below against the wheels here and the packages the image already has
# (httpx, h11, click, idna, httpcore, certifi, and torch, transformers, triton, numpy). anyio and
# typing_extensions are carried too: fastapi/pydantic need recent ones. xgrammar (with its
# apache-tvm-ffi) serves response_format and forced tool calls; on CUDA it masks with Triton.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.stage/whl
PKGS=(
    fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
    pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
    typing_extensions==4.16.0 anyio==4.16.0 uvicorn==0.55.0
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
)
# Python 3.12 / x86-64 wheels (the GPU image's python3); pure-Python ones (py3-none-any) match
# these flags too.
rm -rf "$DEST" && mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${PKGS[@]}"

# Every dependency of every wheel (markers evaluated for Python 3.12, extras off) must be a wheel
# here or a package of the image: --no-deps on the GPU side would not notice a missing one.
python3 - "$DEST" <<'PYEOF'
import pathlib, re, sys, zipfile
from packaging.requirements import Requirement
IMAGE = {"idna", "h11", "click", "httpx", "httpcore", "certifi",  # in the GPU image
         "torch", "transformers", "triton", "numpy"}
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
wheels = {norm(w.name.split("-")[0]): w for w in pathlib.Path(sys.argv[1]).glob("*.whl")}
missing = []
for name, w in sorted(wheels.items()):
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        r = Requirement(line.split(":", 1)[1].strip())
        if r.marker and not r.marker.evaluate({"python_version": "3.12", "extra": ""}):
            continue
        if norm(r.name) not in wheels and norm(r.name) not in IMAGE:
            missing.append(f"{name} needs {r}")
print("\n".join(missing) or f"{len(wheels)} wheels; every dependency is a wheel here or in the image")
sys.exit(1 if missing else 0)
PYEOF
du -sh "$DEST"
