"""A process that installs the verl facade, as a verl driver would; run by ``test_install.py``.

    python facade_job.py URL ACTION [ARGS...]

Actions:
    serve TMPDIR      install(URL); write rows; start a child process that imports ``transfer_queue``
                      and reads them and writes one back; save a checkpoint, stop the deployment,
                      start another and load it; print a JSON summary
    child             (started by ``serve``) the child: it only has the environment it inherited
    refuse            ``import transfer_queue`` (the real one) first: install must refuse (``serve``
                      ends with it, after its uninstall)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def _rows() -> Any:
    import torch
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    return TensorDict(
        {
            "responses": torch.arange(10).view(2, 5),
            "rm_scores": torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.5]]),
            "uid": NonTensorStack(NonTensorData("p0"), NonTensorData("p1")),
        },
        batch_size=[2],
    )


def serve(url: str, tmpdir: str) -> dict[str, Any]:
    import integrations.verl as iv
    from dataplane import InvalidArgument

    try:
        iv.install("memory://")  # a store of one process: refused, and nothing changed
    except InvalidArgument as e:
        out_memory = str(e)
    else:
        raise AssertionError("install('memory://') was accepted")
    if iv.installed_url() is not None or any(k.startswith("DATAPLANE_VERL_") for k in os.environ):
        raise AssertionError("a refused install left its environment behind")
    env = iv.install(url)
    import torch
    import transfer_queue as tq
    from tensordict import TensorDict

    out: dict[str, Any] = {"facade": bool(getattr(tq, "FACADE", False)), "env": sorted(env), "memory": out_memory}
    tq.kv_batch_put(keys=["p0", "p1"], partition_id="train", tags=[{"is_prompt": True, "status": "pending"}] * 2)
    tq.kv_batch_put(keys=["p0_0", "p1_0"], partition_id="train", fields=_rows(), tags=[{"seq_len": 5}] * 2)
    child = subprocess.run(
        [sys.executable, __file__, "-", "child"], capture_output=True, text=True, timeout=180, env=dict(os.environ)
    )
    if child.returncode:
        raise RuntimeError(child.stderr[-3000:])
    out["child"] = json.loads(child.stdout.strip().splitlines()[-1])
    back = tq.kv_batch_get(keys=["p1_0", "p0_0"], partition_id="train", select_fields=["old_log_probs"])
    out["written_back"] = back["old_log_probs"].values().tolist()
    out["listing"] = tq.kv_list()
    before = {k: tq.kv_batch_get(keys=[k], partition_id="train") for k in ["p0_0", "p1_0"]}
    tq.save_checkpoint(os.path.join(tmpdir, "ckpt"), metadata={"global_steps": 3})
    first_url = iv.installed_url()
    iv.uninstall()  # the deployment is gone, and its rows with it
    iv.install(url)
    import transfer_queue as tq2  # the facade again (a new module object after uninstall)

    out["new_deployment"] = iv.installed_url() != first_url or url.startswith("tq://")
    out["empty_after_restart"] = tq2.kv_list() == {}
    out["loaded_metadata"] = tq2.load_checkpoint(os.path.join(tmpdir, "ckpt"))
    out["listing_after_load"] = tq2.kv_list()
    same = True
    for k, want in before.items():
        got = tq2.kv_batch_get(keys=[k], partition_id="train")
        same &= list(got.keys()) == list(want.keys())
        for f in want.keys():
            a, b = got.get(f), want.get(f)
            if isinstance(a, torch.Tensor):
                same &= bool(torch.equal(a.values(), b.values()) if a.is_nested else torch.equal(a, b))
            else:
                same &= a.tolist() == b.tolist()
    out["restored_equal"] = same
    assert isinstance(
        tq2.kv_batch_put(keys=["x"], partition_id="t", fields=TensorDict({}, [1]), tags=[{}]), tq2.KVBatchMeta
    )
    iv.uninstall()
    out["refused"] = refuse(url)["refused"]  # now the real TransferQueue is importable again
    return out


def child() -> dict[str, Any]:
    """A process started after install: its environment alone makes ``transfer_queue`` the facade."""
    import torch
    import transfer_queue as tq
    from tensordict import TensorDict

    tq.init()
    got = tq.kv_batch_get(keys=["p0_0", "p1_0", "missing"], partition_id="train")
    logp = torch.nested.nested_tensor_from_jagged(-got["responses"].values().float(), got["responses"].offsets())
    meta = tq.kv_batch_put(
        keys=["p0_0", "p1_0"], partition_id="train", fields=TensorDict({"old_log_probs": logp}, batch_size=[2])
    )
    tq.close()
    return {
        "facade": bool(getattr(tq, "FACADE", False)),
        "fields": list(got.keys()),
        "uid": got["uid"],
        "responses": got["responses"].values().tolist(),
        "put_fields": meta.fields,
        "put_tags": meta.tags,
    }


def refuse(url: str) -> dict[str, Any]:
    """``import transfer_queue`` (the real one), then ``install``: it must refuse."""
    import transfer_queue

    if getattr(transfer_queue, "FACADE", False):
        raise AssertionError("transfer_queue is still the facade after uninstall()")

    import integrations.verl as iv

    try:
        iv.install(url)
    except RuntimeError as e:
        return {"refused": str(e)}
    return {"refused": None}


if __name__ == "__main__":
    url, action, *rest = sys.argv[1:]
    result = {"serve": lambda: serve(url, rest[0]), "child": child, "refuse": lambda: refuse(url)}[action]()
    print(json.dumps(result))
