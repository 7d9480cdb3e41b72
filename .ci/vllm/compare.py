"""Compare vLLM's own tests run on vLLM's KV-cache manager and on pagedkv's.

Usage: python compare.py BASELINE.json PAGEDKV.json COUNTS.json ALLOWLIST

BASELINE and PAGEDKV map node ids to outcomes (outcomes_plugin.py); COUNTS is the pagedkv
plugin's report (schedulers and managers built per test). Fails (exit 1) on:
- a regression: a test that passed on vLLM's manager but not on pagedkv's, unless the
  allow-list names it (each allow-list line: `node id  # why`; lines without a reason are
  refused);
- a swap that did nothing: a test that built a scheduler but no pagedkv manager.
Prints the summary either way; allow-list entries that now pass are reported as stale.
"""

import json
import sys


def read_allowlist(path: str) -> dict[str, str]:
    allowed: dict[str, str] = {}
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            nodeid, sep, reason = line.partition("#")
            if not sep or not reason.strip():
                sys.exit(f"{path}:{number}: every allow-list line needs a reason after '#'")
            allowed[nodeid.strip()] = reason.strip()
    return allowed


def main() -> int:
    if len(sys.argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    with open(sys.argv[1]) as f:
        baseline = json.load(f)
    with open(sys.argv[2]) as f:
        pagedkv = json.load(f)
    with open(sys.argv[3]) as f:
        counts = json.load(f)
    allowed = read_allowlist(sys.argv[4])

    passed_on_vllm = sorted(n for n, outcome in baseline.items() if outcome == "passed")
    regressions, allowed_failures, stale = [], [], []
    for nodeid in passed_on_vllm:
        outcome = pagedkv.get(nodeid, "missing")
        if outcome == "passed":
            if nodeid in allowed:
                stale.append(nodeid)
        elif nodeid in allowed:
            allowed_failures.append(nodeid)
        else:
            regressions.append(f"{nodeid}: {outcome} on pagedkv")
    not_swapped = sorted(
        nodeid
        for nodeid, count in counts.items()
        if count["schedulers"] > 0 and count["pagedkv_managers"] == 0
    )
    num_pass = sum(1 for n in passed_on_vllm if pagedkv.get(n) == "passed")
    print(
        f"vLLM's manager: {len(passed_on_vllm)} of {len(baseline)} passed; "
        f"pagedkv's: {num_pass} of those pass, {len(allowed_failures)} allow-listed, "
        f"{len(regressions)} regressions; "
        f"{sum(1 for c in counts.values() if c['pagedkv_managers'])} tests built a pagedkv manager"
    )
    for nodeid in allowed_failures:
        print(f"  allowed: {nodeid}  ({allowed[nodeid]})")
    for nodeid in stale:
        print(f"  stale allow-list entry (passes now): {nodeid}")
    for line in regressions:
        print(f"  REGRESSION {line}")
    for nodeid in not_swapped:
        print(f"  NOT SWAPPED {nodeid}: built a scheduler but no pagedkv manager")
    return 1 if regressions or not_swapped else 0


if __name__ == "__main__":
    sys.exit(main())
