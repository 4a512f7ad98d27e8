"""`prefill.tensorParallelSize` / `decode.tensorParallelSize` / `worker.tensorParallelSize`: the worker's rank
count (`--tensor-parallel-size`) and the GPUs its pod requests (gpus per rank x ranks)."""
from tests.helm._chart import FULL, by_kind, objects, pod_template


def _worker(dep) -> tuple[list[str], dict]:
    c = pod_template(dep)["containers"][0]
    return c["args"], c["resources"]


def test_tensor_parallel_size_sets_ranks_and_gpus_per_pod():
    d = by_kind(objects({"prefill": {"tensorParallelSize": 4}, "decode": {"tensorParallelSize": 2, "gpus": 1}}),
                "Deployment")
    for pool, tp in (("prefill", 4), ("decode", 2)):
        args, res = _worker(d[f"{FULL}-{pool}"])
        i = args.index("--tensor-parallel-size")
        assert args[i + 1] == str(tp)
        for k in ("limits", "requests"):
            assert res[k]["nvidia.com/gpu"] == tp
    # the default: one rank, one GPU, no flag
    args, res = _worker(by_kind(objects(), "Deployment")[f"{FULL}-decode"])
    assert "--tensor-parallel-size" not in args and res["limits"]["nvidia.com/gpu"] == 1
    # colocated workers too; a CPU pool (gpus 0) requests none whatever its ranks
    c = by_kind(objects({"mode": "colocated", "worker": {"tensorParallelSize": 2, "gpus": 0}}), "Deployment")
    args, res = _worker(c[f"{FULL}-worker"])
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "nvidia.com/gpu" not in str(res)


def test_expert_parallel_size_is_passed_per_pool():
    d = by_kind(objects({"prefill": {"tensorParallelSize": 2, "expertParallelSize": 2}}), "Deployment")
    args, _ = _worker(d[f"{FULL}-prefill"])
    assert args[args.index("--expert-parallel-size") + 1] == "2"
    args, _ = _worker(d[f"{FULL}-decode"])
    assert "--expert-parallel-size" not in args  # the default: 1, no flag
    # EP without TP: one rank (and one GPU each) per expert-parallel rank
    d = by_kind(objects({"decode": {"expertParallelSize": 4, "gpus": 1}}), "Deployment")
    args, res = _worker(d[f"{FULL}-decode"])
    assert args[args.index("--expert-parallel-size") + 1] == "4" and res["limits"]["nvidia.com/gpu"] == 4
