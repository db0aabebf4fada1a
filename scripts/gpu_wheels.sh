#!/usr/bin/env bash
# make gpu-wheels: the wheels the GPU test machine's image lacks (requirements/gpu-wheels.txt,
# at the lock's versions), for its CPython 3.12 on manylinux x86_64, into a git-ignored folder,
# with SmolLM2's tokenizer files beside them (the check's random models use its vocabulary).
# scripts/gpu_check.sh installs them there with --no-index --no-deps --target.
#
# Usage: scripts/gpu_wheels.sh [DIR]   (default .gpu-wheels; PYTHON: the venv's python)
set -euo pipefail

cd "$(dirname "$0")/.."
DIR="${1:-.gpu-wheels}"
PYTHON="${PYTHON:-.venv/bin/python}"
LOCK=requirements/constraints.txt

pins=()
while read -r name; do
    [[ -z "$name" || "$name" == \#* ]] && continue
    pin="$(grep -i "^${name}==" "$LOCK" || true)"
    if [[ -z "$pin" ]]; then
        echo "gpu-wheels: $name is not in $LOCK (make lock after installing it)" >&2
        exit 1
    fi
    pins+=("$pin")
done <requirements/gpu-wheels.txt

mkdir -p "$DIR"
rm -f "$DIR"/*.whl # one version of each: two would stop the install there
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 \
    manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$DIR" "${pins[@]}"

# Every requirement of every wheel (for Python 3.12 on Linux x86_64, no extras) must be met by
# another wheel here or by the image.
"$PYTHON" - "$DIR" <<'EOF'
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

folder = Path(sys.argv[1])
image = {
    canonicalize_name(line.strip())
    for line in Path("requirements/gpu-image.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}
wheels = sorted(folder.glob("*.whl"))
carried = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels}
target = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "extra": "",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "os_name": "posix"}  # fmt: skip
unmet = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode())
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(target):
            continue
        wanted = canonicalize_name(requirement.name)
        if wanted not in carried and wanted not in image:
            unmet.append(f"{wheel.name} needs {requirement}")
if unmet:
    sys.exit("gpu-wheels: requirements neither carried nor in the image:\n  " + "\n  ".join(unmet))
print(f"gpu-wheels: {len(wheels)} wheels; every requirement carried or in the image")
EOF

PYTHONPATH=. "$PYTHON" -c "
import sys
from pathlib import Path
sys.path.insert(0, 'scripts')
from gpu_check import write_tokenizer
target = Path('$DIR') / 'tokenizer'
if not (target / 'tokenizer.json').exists():
    write_tokenizer(target)
print('gpu-wheels: tokenizer files in', target)
"
du -sh "$DIR"
