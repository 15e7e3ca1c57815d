"""Generate the Python code of the event-log schema (proto/) into otel_agentcap/_proto/.

The generator is pinned: ``grpcio-tools==1.63.2`` from the ``dev`` extra (protoc 26.1, protobuf
5.26.1 gencode, the same as opentelemetry-proto's; it loads on every protobuf runtime the package
admits). The generated files are committed; ``--check`` regenerates into a temporary directory and
fails when the committed files differ (tests/test_proto.py runs it).

    .venv/bin/python scripts/generate_proto.py [--check]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
SOURCES = ("agentcap/eventlog/v1/eventlog.proto",)
TARGET = ROOT / "otel_agentcap" / "_proto"
GENERATOR = "grpcio-tools==1.63.2"


def generate(out: Path) -> list[Path]:
    """Run the pinned protoc over SOURCES; returns the generated files, flattened into ``out``."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:
        raise SystemExit(f"the generator is missing: pip install '{GENERATOR}' ({exc})") from None
    with tempfile.TemporaryDirectory() as raw:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={raw}", f"--pyi_out={raw}"]
        if protoc.main([*args, *SOURCES]) != 0:
            raise SystemExit("protoc failed")
        written = []
        for source in SOURCES:
            stem = Path(source).with_suffix("")
            for suffix in ("_pb2.py", "_pb2.pyi"):
                generated = Path(raw) / f"{stem}{suffix}"
                target = out / f"{stem.name}{suffix}"
                shutil.copyfile(generated, target)
                written.append(target)
        return written


def stale_files() -> list[str]:
    """The committed generated files that differ from what the pinned generator writes now."""
    with tempfile.TemporaryDirectory() as fresh:
        stale = []
        for generated in generate(Path(fresh)):
            committed = TARGET / generated.name
            if not committed.exists() or committed.read_bytes() != generated.read_bytes():
                stale.append(str(committed.relative_to(ROOT)))
        return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale generated code (run scripts/generate_proto.py): {', '.join(stale)}")
            return 1
        print("generated code is up to date")
        return 0
    TARGET.mkdir(exist_ok=True)
    for path in generate(TARGET):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
