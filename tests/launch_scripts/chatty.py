"""Print many numbered lines to stdout, then exit 0 (output forwarding under a slow or closed console)."""

import sys

lines = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
for i in range(lines):
    print(f"line {i} " + "x" * 60)
