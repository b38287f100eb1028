"""Start-up of `zhuzi serve`: seconds until /health answers 200, and the process's peak RSS.

    python benchmarks/startup.py [--kv-cache-memory 1GiB] [--port 8012]
"""
import argparse
import subprocess
import sys
import time
import urllib.request


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--port", type=int, default=8012)
    args = ap.parse_args()
    start = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "zhuzi.cli", "--log-level", "WARNING", "serve", "--port",
                               str(args.port), "--kv-cache-memory", args.kv_cache_memory],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=1):
                    break
            except OSError:
                if server.poll() is not None:
                    sys.exit("zhuzi serve exited before it was healthy")
                time.sleep(0.05)
        ready = time.monotonic() - start
        status = dict(line.split(":", 1) for line in open(f"/proc/{server.pid}/status"))
        print(f"/health 200 after {ready:.2f} s; peak RSS {status['VmHWM'].strip()} "
              f"with a {args.kv_cache_memory} KV budget")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
