"""Compare vLLM's own tests run on vLLM's KV-cache manager and on pagedkv's.

Usage:
  compare.py suite NAME RESULTS_DIR ALLOWLIST KNOWN_GAPS
  compare.py coverage ALLOWLIST KNOWN_GAPS RESULTS_DIR

`suite` reads RESULTS_DIR/NAME-{vllm,pagedkv}.json (node id -> outcome, outcomes_plugin.py),
NAME-{vllm,pagedkv}-counts.json (per test, the schedulers and managers of each kind built:
pagedkv.integrations.vllm.pytest_plugin) and NAME-{vllm,pagedkv}-details.json (failure causes,
seconds per file). It prints a table per test file and fails (exit 1) on:
- a regression: a test that passed on vLLM's manager but not on pagedkv's, unless the
  allow-list or the known-gaps file names it;
- a swap that did nothing: a test that built a vLLM manager in the pagedkv run, or built a
  scheduler there but no pagedkv manager;
- a stale known gap: an entry for a test of these files that passes on pagedkv now, or is
  not a test that passes on vLLM (the file lists exactly today's gaps; delete the line).
Tests that built no manager at all are counted and listed in RESULTS_DIR/NAME-no-manager.txt
(not a failure: many of vLLM's files also test helpers). Stale allow-list entries are
reported.

The allow-list (`node id  # category: why`) may hold only tests that need a model config that
cannot be downloaded here (`model-config:`) or a feature vLLM itself marks experimental
(`experimental:`); any other line is refused. The known-gaps file (`node id  # need; need...`)
lists the tests that fail for what pagedkv's drop-in does not have yet (issue 23); they are
printed loudly, counted by need.

`coverage` fails if an entry of either file names a test file that no suite ran.
"""

import json
import os
import sys
from collections import Counter

ALLOWED_CATEGORIES = ("model-config:", "experimental:")


def read_entries(path: str, categories: tuple[str, ...] = ()) -> dict[str, str]:
    """`node id -> reason` of an allow-list or known-gaps file; exits on a malformed line."""
    entries: dict[str, str] = {}
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            nodeid, sep, reason = line.partition("  # ")
            nodeid, reason = nodeid.strip(), reason.strip()
            if not sep or not reason or not nodeid:
                sys.exit(f"{path}:{number}: expected `<node id>  # <reason>`")
            if categories and not reason.startswith(categories):
                sys.exit(
                    f"{path}:{number}: an allow-list reason starts with one of "
                    f"{', '.join(categories)} (got {reason!r})"
                )
            if nodeid in entries:
                sys.exit(f"{path}:{number}: {nodeid} is listed twice")
            entries[nodeid] = reason
    return entries


def load(results: str, name: str, kind: str, part: str) -> dict:
    path = os.path.join(results, f"{name}-{kind}{part}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def test_file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def describe(failure: dict | None) -> str:
    if not failure:
        return ""
    where = failure.get("pagedkv_frame") or failure.get("last_frame", "")
    where = where.rsplit("/", 2)[-2:] if where else []
    return f"{failure['type']}: {failure['message'][:160]} [{'/'.join(where)}]"


def suite(name: str, results: str, allowlist_path: str, known_gaps_path: str) -> int:
    allowed = read_entries(allowlist_path, ALLOWED_CATEGORIES)
    known_gaps = read_entries(known_gaps_path)
    both = sorted(set(allowed) & set(known_gaps))
    if both:
        sys.exit(f"listed in both {allowlist_path} and {known_gaps_path}: {', '.join(both)}")
    baseline = load(results, name, "vllm", "")
    pagedkv = load(results, name, "pagedkv", "")
    vllm_counts = load(results, name, "vllm", "-counts")
    counts = load(results, name, "pagedkv", "-counts")
    vllm_details = load(results, name, "vllm", "-details")
    details = load(results, name, "pagedkv", "-details")
    if not baseline:
        print(f"  FAILED: no results of the run on vLLM's manager ({name}-vllm.json)")
        return 1
    failures = details.get("failures", {})

    files = sorted({test_file(n) for n in baseline} | {test_file(n) for n in pagedkv})
    regressions: list[str] = []
    gaps: list[str] = []
    allowed_failures: list[str] = []
    stale_gaps: list[str] = []
    stale_allowed: list[str] = []
    for nodeid in sorted(baseline):
        if baseline[nodeid] != "passed":
            continue
        outcome = pagedkv.get(nodeid, "missing")
        if outcome == "passed":
            if nodeid in known_gaps:
                stale_gaps.append(f"{nodeid}: passes on pagedkv now")
            if nodeid in allowed:
                stale_allowed.append(nodeid)
        elif nodeid in known_gaps:
            gaps.append(nodeid)
        elif nodeid in allowed:
            allowed_failures.append(nodeid)
        else:
            regressions.append(f"{nodeid}: {outcome} on pagedkv  {describe(failures.get(nodeid))}")
    for nodeid in known_gaps:
        if test_file(nodeid) in files and baseline.get(nodeid) != "passed":
            stale_gaps.append(f"{nodeid}: {baseline.get(nodeid, 'not run')} on vLLM's manager")

    not_swapped = sorted(
        f"{nodeid}: built {c['vllm_managers']} vLLM manager(s) in the pagedkv run"
        for nodeid, c in counts.items()
        if c["vllm_managers"] > 0
    ) + sorted(
        f"{nodeid}: built a scheduler but no pagedkv manager"
        for nodeid, c in counts.items()
        if c["schedulers"] > 0 and c["pagedkv_managers"] == 0 and c["vllm_managers"] == 0
    )
    no_manager = sorted(
        nodeid
        for nodeid, c in counts.items()
        if c["pagedkv_managers"] == 0 and c["vllm_managers"] == 0
    )
    with open(os.path.join(results, f"{name}-no-manager.txt"), "w") as f:
        f.writelines(f"{nodeid}\n" for nodeid in no_manager)

    vllm_seconds = vllm_details.get("seconds_per_file", {})
    seconds = details.get("seconds_per_file", {})
    header = (
        f"  {'file':<58} {'vLLM':>9} {'pagedkv':>7} {'manager':>7} {'gaps':>5} {'allow':>5} "
        f"{'regr':>4} {'s vLLM':>7} {'s pkv':>6}"
    )
    print(header)
    for path in files:
        in_file = [n for n in baseline if test_file(n) == path]
        passed = [n for n in in_file if baseline[n] == "passed"]
        print(
            f"  {path.removeprefix('tests/'):<58} "
            f"{len(passed):>4}/{len(in_file):<4} "
            f"{sum(pagedkv.get(n) == 'passed' for n in passed):>7} "
            f"{sum(vllm_counts.get(n, {}).get('vllm_managers', 0) > 0 for n in passed):>7} "
            f"{sum(n in known_gaps for n in passed if pagedkv.get(n) != 'passed'):>5} "
            f"{sum(n in allowed for n in passed if pagedkv.get(n) != 'passed'):>5} "
            f"{sum(1 for r in regressions if test_file(r) == path):>4} "
            f"{vllm_seconds.get(path, 0.0):>7.1f} {seconds.get(path, 0.0):>6.1f}"
        )
    print(
        "  (vLLM: passed/collected on vLLM's manager; pagedkv: of those, passed on pagedkv's; "
        "manager: of those, built a vLLM manager on vLLM's run)"
    )
    print(
        f"  {len(no_manager)} tests built no KV-cache manager at all "
        f"(listed in {name}-no-manager.txt)"
    )
    if gaps:
        print(f"  KNOWN GAPS (issue 23): {len(gaps)} tests that pass on vLLM's manager fail on")
        print(f"  pagedkv's, listed in {known_gaps_path}; what they need (one test may need more):")
        needs = Counter(need for n in gaps for need in known_gaps[n].split("; "))
        for need, number in needs.most_common():
            print(f"    {number:>4}  {need}")
    for nodeid in allowed_failures:
        print(f"  allowed: {nodeid}  ({allowed[nodeid]})")
    for nodeid in stale_allowed:
        print(f"  stale allow-list entry (passes now): {nodeid}")
    for line in stale_gaps:
        print(f"  STALE KNOWN GAP (delete the line) {line}")
    for line in regressions:
        print(f"  REGRESSION {line}")
    for line in not_swapped:
        print(f"  NOT SWAPPED {line}")
    return 1 if regressions or not_swapped or stale_gaps else 0


def coverage(allowlist_path: str, known_gaps_path: str, results: str) -> int:
    files: set[str] = set()
    for entry in os.listdir(results):
        if entry.endswith("-vllm.json"):
            with open(os.path.join(results, entry)) as f:
                files.update(test_file(n) for n in json.load(f))
    status = 0
    for path in (allowlist_path, known_gaps_path):
        categories = ALLOWED_CATEGORIES if path == allowlist_path else ()
        for nodeid in read_entries(path, categories):
            if test_file(nodeid) not in files:
                print(f"  {path}: {nodeid} is in a file no suite ran")
                status = 1
    return status


def main() -> int:
    if len(sys.argv) == 6 and sys.argv[1] == "suite":
        return suite(*sys.argv[2:])
    if len(sys.argv) == 5 and sys.argv[1] == "coverage":
        return coverage(*sys.argv[2:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
