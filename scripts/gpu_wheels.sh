#!/usr/bin/env bash
# Wheels the lent CUDA machine's image lacks, for `scripts/gpu_checks.sh` (the device tool's README:
# nothing can be installed there from a registry). Downloads, for CPython 3.12 on x86-64 manylinux,
# the versions this checkout's .venv holds into .whl/ (git-ignored through .git/info/exclude; name
# it in the device call's `carry`): gguf for the GGUF tests, fastapi / pydantic / starlette / uvicorn
# (which imports opentelemetry-api) for serving, openai and anthropic with their own needs for the serving tests. ~8 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
mkdir -p .whl
for name in gguf fastapi pydantic pydantic_core starlette annotated-types annotated-doc typing-inspection uvicorn \
            openai anthropic docstring-parser distro jiter sniffio httpx2 httpcore2 truststore opentelemetry-api anyio \
            h11 click idna; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "gpu_wheels: $name is not installed in $PY's environment; skipped" >&2; continue; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$name==$version" 2>&1 | grep -v '^WARNING: Location' || true
done
ls .whl
