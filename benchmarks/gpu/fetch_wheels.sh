#!/usr/bin/env bash
# Run HERE (a host with a package registry) before a GPU check: the wheels of what the project
# imports that the GPU machine's image lacks (gguf, pydantic, llguidance, jsonschema and theirs),
# for its Python 3.12 on x86-64, into .whl/ (git-ignored; pass carry: [".whl"] to the device run).
# Each at the version installed here, so the set is one that pip resolved together (installed
# there with --no-deps: nothing the image holds, numpy or torch, is replaced).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl $(python3 - <<'PY'
from importlib.metadata import version
names = ["gguf", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
         "jsonschema", "jsonschema-specifications", "referencing", "rpds-py"]
print(" ".join(f"{n}=={version(n)}" for n in names), "llguidance")  # abi3, no dependencies: any release
PY
)
ls .whl
