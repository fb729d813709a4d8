"""Forwards to the prepared GPU check, bench/tools/gpu_check.py: same arguments, same output and exit
status. This path stays because the GPU machines' instructions run ``python3 bench/gpu_check.py``
as prepared; everything else names bench/tools/gpu_check.py."""

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    target = Path(__file__).resolve().parent / "tools" / "gpu_check.py"
    sys.argv[0] = str(target)
    runpy.run_path(str(target), run_name="__main__")
