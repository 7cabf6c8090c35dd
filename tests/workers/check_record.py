"""What a worker script of the multi-worker tests reports: one JSON file per
rank with each check's outcome; the first failure ends the process (exit 3)
so the others fail fast on the missing peer instead of waiting."""
import json
import os
import sys
import time
import traceback


class Checks:
    def __init__(self, out_dir, rank, size):
        self.path = os.path.join(out_dir, f"rank{rank}.json")
        self.rank, self.size = rank, size
        self.results = {}

    def run(self, name, fn):
        start = time.monotonic()
        try:
            detail = fn()
            # seconds: what each check costs, for whoever trims a long file
            self.results[name] = {"ok": True, "detail": detail or "",
                                  "seconds": round(time.monotonic() - start, 2)}
        except Exception as exc:  # recorded, asserted by the test
            self.results[name] = {"ok": False,
                                  "detail": f"{exc}\n{traceback.format_exc()[-3000:]}"}
            self.write()
            print(f"rank {self.rank}: check {name} failed: {exc}", file=sys.stderr, flush=True)
            os._exit(3)
        self.write()

    def write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": self.rank, "size": self.size, "checks": self.results}, f)
        os.replace(tmp, self.path)
