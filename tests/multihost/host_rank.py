"""One rank of a replica group spread over two hosts (the multi-host tests): gloo over the hosts' link.

    python host_rank.py RANK MASTER_ADDR PORT URL

Rank 0 (the group's leader) writes rows and broadcasts their meta; both ranks fetch them with leader
broadcast (only the leader reads the store) and check every byte; the leader writes one field back;
then rank 1 reads that field from the store on its own host. Prints one JSON line.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist


def main(rank: int, master: str, port: int, url: str) -> dict[str, Any]:
    from dataplane.worker import DataPlaneWorkerMixin

    out: dict[str, Any] = {"rank": rank, "error": None}
    t0 = time.monotonic()
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:

        class Worker(DataPlaneWorkerMixin):
            def replica_group(self) -> Any:
                return dist.group.WORLD

        worker = Worker()
        worker.data_plane_timeout_s = 60.0
        client = worker.setup_data_plane(url)
        g = torch.Generator().manual_seed(11)
        rows = [torch.randint(0, 2**40, (int(n),), generator=g) for n in torch.randint(10, 3000, (16,), generator=g)]
        box: list[Any] = [None]
        if rank == 0:
            ids = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
            box[0] = client.kv_batch_put([f"r{i}" for i in range(16)], {"ids": ids}, partition_id="ranks")
        dist.broadcast_object_list(box, src=0)
        meta = box[0]
        got = worker.fetch(meta, select_fields=["ids"], layout="jagged", policy="leader_broadcast")
        stats = worker.last_fetch_stats
        out["fetch"] = None if stats is None else [stats.policy, stats.role, stats.store_bytes, stats.broadcast_bytes]
        out["exact"] = all(torch.equal(got["ids"][i], rows[i]) for i in range(16))
        half = torch.zeros(16, max(len(r) for r in rows))
        for i, r in enumerate(rows):
            half[i, : len(r)] = (r % 1000).float() * 0.5
        written = worker.write_back(meta, {"half": half}, token_fields=["half"])
        out["wrote"] = written is not None
        dist.barrier()
        if rank == 1:  # what the leader on the other host wrote, read from this host
            back = client.kv_batch_get(meta, select_fields=["half"])
            out["written_back_exact"] = all(
                torch.equal(back["half"][i], (rows[i] % 1000).float() * 0.5) for i in range(16)
            )
        dist.barrier()
        worker.close_data_plane()
    except Exception as e:
        out["error"] = [type(e).__name__, str(e)[:500], traceback.format_exc()[-2000:]]
    finally:
        dist.destroy_process_group()
    out["seconds"] = time.monotonic() - t0
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4])), flush=True)
