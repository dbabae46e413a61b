"""Where the runtime's threads spend one job's run: every thread's stack sampled every 0.5 ms
while the stop hook's job (a Flax TrainState MLP, 1 x 3000 steps, fifo) runs under xshare,
after one warm-up run. Prints the leaf lines seen most, then the xshare frames on each
thread's stack (inclusive), as shares of all samples. A sampler, not a tracer: shares, not
times, and threads that wait are sampled too (read the dispatcher's rows).

usage: python benchmarks/gpu/prof.py PATH/TO/sidebyside.py   (benchmarks/gpu/check.sh runs it)
"""

from __future__ import annotations

import collections
import sys
import threading
import time

HOOK = sys.argv[1] if len(sys.argv) > 1 else ".gpu/sidebyside.py"


def _hook() -> dict:
    """The hook's definitions (its state, step, data and ``shared``), without running it."""
    sys.argv = [sys.argv[0], "1", "3000"]  # the hook reads N and STEPS from argv at import
    src = open(HOOK).read().split("WAYS = ")[0]
    ns = {"__name__": "sidebyside", "__file__": HOOK}
    exec(compile(src, HOOK, "exec"), ns)  # the project's own hook, read to reuse its job
    return ns


def main() -> None:
    hook = _hook()
    leaf: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    done = threading.Event()
    main_ident = threading.get_ident()

    def sample() -> None:
        me = threading.get_ident()
        while not done.is_set():
            names = {t.ident: t.name[:18] for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident in (me, main_ident):
                    continue
                name = names.get(ident, "?")
                code = frame.f_code
                leaf[f"{name} | {code.co_filename.split('site-packages/')[-1]}:{frame.f_lineno} {code.co_name}"] += 1
                seen = set()
                f = frame
                while f is not None:
                    if "xshare" in f.f_code.co_filename:
                        key = f"{name} | {f.f_code.co_filename.split('xshare/')[-1]}:{f.f_code.co_name}"
                        if key not in seen:
                            inclusive[key] += 1
                            seen.add(key)
                    f = f.f_back
            time.sleep(0.0005)

    print("warm-up run", round(hook["shared"](policy="fifo"), 3), "s")
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    print("sampled run", round(hook["shared"](policy="fifo"), 3), "s")
    done.set()
    sampler.join()
    total = sum(leaf.values())
    print("LEAF", total, "samples")
    for key, n in leaf.most_common(30):
        print(f"{n / total:6.1%} {key}")
    print("INCLUSIVE (xshare frames)")
    for key, n in inclusive.most_common(30):
        print(f"{n / total:6.1%} {key}")


if __name__ == "__main__":
    main()
