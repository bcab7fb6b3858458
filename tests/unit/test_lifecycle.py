"""The service entry points' process lifecycle: the start-up heap taken out of the garbage
collector's full scans."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

#: Run in a process of its own: freezing is for the life of a process, and the test runner's
#: heap must not be frozen under every later test.
_FREEZE_IN_A_SERVICE_PROCESS = """
import gc, json, weakref
import services.gateway.server  # what a gateway process holds before it serves

class Node:
    pass

kept = Node(); kept.self = kept                    # alive at start-up: frozen
dropped = Node(); dropped.self = dropped           # garbage at start-up: collected, not frozen
dropped_ref = weakref.ref(dropped); del dropped

from services.common.lifecycle import freeze_startup_heap
heap = freeze_startup_heap()
scanned = {id(o) for g in range(3) for o in gc.get_objects(generation=g)}
print(json.dumps({
    "objects": heap.objects,
    "freeze_count": gc.get_freeze_count(),
    "before_ms": heap.full_collection_ms,
    "after_ms": heap.full_collection_after_ms,
    "kept_scanned": id(kept) in scanned,
    "dropped_collected": dropped_ref() is None,
}))
"""


def test_the_start_up_heap_leaves_the_collectors_scans_and_its_garbage_is_collected_first() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FREEZE_IN_A_SERVICE_PROCESS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # the gateway's imports alone (gRPC, protobuf, torch for the weights scan) are ~10^5 objects
    assert result["objects"] == result["freeze_count"] > 50_000, result
    assert not result["kept_scanned"], result
    assert result["dropped_collected"], result
    assert result["before_ms"] >= 0 and result["after_ms"] >= 0, result
