"""Each rank starts a helper process in its own process group (a data server, say); rank 0 then fails."""

import os
import subprocess
import sys
import time

helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(sys.argv[1], f"helper{os.environ['RANK']}"), "w") as f:
    f.write(str(helper.pid))
if os.environ["RANK"] == "0":
    time.sleep(1)
    sys.exit(3)
time.sleep(120)
