"""A data-plane client run inside one "host" (network namespace) of the multi-host tests.

    python host_client.py [--defer] URL

connects once, prints ``{"ready": true, "token": ...}`` (``token``: a Mooncake client's deployment
token), then answers one JSON line per command line on stdin. With ``--defer`` it imports what
connecting to ``URL`` needs, then waits for a ``connect`` line first (a test starts it while the
deployment is still coming up). The commands:

    write PARTITION TAG N      put N rows, keys TAG-0..N-1
    read PARTITION TAG N       read them back and check every byte

Rows are a deterministic function of (TAG, i): a jagged int64 ``ids`` row and a float32 ``score``,
so a reader on another host checks them without being told them. An answer is
``{"ok": ..., "rows": ..., "mismatched": [...], "error": [type, message] | null, "seconds": ...}``.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from typing import Any

import torch


def row(tag: str, i: int) -> tuple[torch.Tensor, float]:
    g = torch.Generator().manual_seed(sum(map(ord, tag)) * 1000 + i)
    n = int(torch.randint(50, 4000, (1,), generator=g))
    return torch.randint(0, 2**40, (n,), generator=g, dtype=torch.int64), float(i) + 0.25


def serve(client: Any, op: str, partition: str, tag: str, n: str) -> dict[str, Any]:
    count = int(n)
    keys = [f"{tag}-{i}" for i in range(count)]
    out: dict[str, Any] = {"ok": False, "rows": 0, "mismatched": [], "error": None}
    t0 = time.monotonic()
    try:
        if op == "write":
            rows = [row(tag, i) for i in range(count)]
            ids = torch.nested.as_nested_tensor([r[0] for r in rows], layout=torch.jagged)
            client.kv_batch_put(keys, {"ids": ids, "score": torch.tensor([r[1] for r in rows])}, partition_id=partition)
        else:
            got = client.kv_batch_get(keys, select_fields=["ids", "score"], partition_id=partition)
            for i in range(count):
                ids, score = row(tag, i)
                if not (torch.equal(got["ids"][i], ids) and float(got["score"][i]) == score):
                    out["mismatched"].append(i)
        out.update(rows=count, ok=not out["mismatched"])
    except Exception as e:
        out["error"] = [type(e).__name__, str(e)[:500]]
        out["trace"] = traceback.format_exc()[-3000:]
    out["seconds"] = time.monotonic() - t0
    return out


def main(args: list[str]) -> None:
    import dataplane

    url = args[-1]
    if args[0] == "--defer":  # the backend's packages import now, before the deployment is up
        if url.startswith("tq://"):
            import ray  # noqa: F401
            import transfer_queue  # noqa: F401
        else:
            import mooncake.store  # noqa: F401
        sys.stdin.readline()
    with dataplane.connect(url) as client:
        token = getattr(getattr(client, "store", None), "deployment_token", None)  # mooncake:// only
        print(json.dumps({"ready": True, "token": token}), flush=True)
        for line in sys.stdin:
            if line.strip():
                print(json.dumps(serve(client, *line.split())), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
