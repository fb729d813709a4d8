"""A built-in model's first conversion (GGUF -> safetensors; nestfed.nn.backbone.convert_builtin),
with the GGUF header parsed once (what nestfed does) and, side by side in the same invocation, as
transformers alone parses it (once for the config, the weights and the tokenizer). Checks that both
write byte-identical files; prints one JSON object.

    .venv/bin/python bench/perf/conversion.py [--model gemma3-270m] [--out bench/results/conversion.json]
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import tempfile
import time
from pathlib import Path
from unittest import mock

from nestfed.nn import backbone


def convert(name: str, folder: Path, shared: bool) -> float:
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if not shared:
            stack.enter_context(mock.patch.object(backbone, "_one_gguf_parse", contextlib.nullcontext))
        backbone.convert_builtin(name, folder)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", choices=sorted(backbone.BUILTINS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shared, plain = Path(tmp) / "shared", Path(tmp) / "plain"
        out = {
            "bench": "conversion",
            "model": args.model,
            "parse_once_s": round(convert(args.model, shared, True), 1),
            "transformers_alone_s": round(convert(args.model, plain, False), 1),
        }
        folder = backbone.BUILTINS[args.model].folder
        files = sorted(p.name for p in (shared / folder).iterdir())
        out["identical_files"] = filecmp.cmpfiles(shared / folder, plain / folder, files, shallow=False)[0] == files
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
