"""Print argv[1] numbered lines of 100 bytes to stdout, note it in argv[2]/printed, and exit 0 once
argv[2]/go exists (at most 60 s later): a job whose log files the test measures while it runs."""

import os
import sys

from spmd.polling import poll

lines, folder = int(sys.argv[1]), sys.argv[2]
out = sys.stdout
for i in range(lines):
    out.write(f"line {i:>12} ".ljust(99, "x") + "\n")
out.flush()
open(os.path.join(folder, "printed"), "w").close()
poll(lambda: os.path.exists(os.path.join(folder, "go")), 60, 0.02)
