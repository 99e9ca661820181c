"""Multi-node launch arguments (workflow.launch_topology / accelerate_launch_args): pure functions of the
train config and the environment (a SLURM allocation, or DFLASH_* variables set per machine)."""

import pytest

from dflash_pipeline.workflow.policy import accelerate_launch_args, first_slurm_host, launch_topology

CFG = {
    "num_processes": 8,
    "num_machines": None,
    "main_process_ip": None,
    "main_process_port": 29500,
    "mixed_precision": "bf16",
}


def test_single_machine_args_unchanged():
    assert accelerate_launch_args(1) == [
        "--num_machines",
        "1",
        "--num_processes",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]
    assert accelerate_launch_args(2)[0] == "--multi_gpu"
    topo = launch_topology({**CFG, "num_processes": 2}, env={})
    assert (topo.num_machines, topo.machine_rank) == (1, 0)
    assert "--machine_rank" not in topo.launch_args()


def test_slurm_allocation_gives_count_rank_and_main_host():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[03-05,9]"}
    topo = launch_topology(CFG, env=env)
    assert (topo.num_machines, topo.machine_rank, topo.main_process_ip, topo.source) == (4, 2, "gpu03", "slurm")
    args = topo.launch_args("bf16")
    assert args[:1] == ["--multi_gpu"]
    a = dict(zip(args[1::2], args[2::2]))
    assert a["--num_processes"] == "32" and a["--num_machines"] == "4" and a["--machine_rank"] == "2"
    assert (
        a["--main_process_ip"] == "gpu03" and a["--main_process_port"] == "29500" and a["--mixed_precision"] == "bf16"
    )
    # a one-node allocation is a single-machine run
    assert launch_topology(CFG, env={**env, "SLURM_JOB_NUM_NODES": "1"}).num_machines == 1


def test_slurm_count_mismatch_and_missing_rank_are_errors():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]"}
    with pytest.raises(ValueError, match="num_machines is 3 but the SLURM allocation has 2"):
        launch_topology({**CFG, "num_machines": 3}, env=env)
    with pytest.raises(ValueError, match="DFLASH_MACHINE_RANK"):
        launch_topology({**CFG, "num_machines": 2, "main_process_ip": "10.0.0.1"}, env={})
    with pytest.raises(ValueError, match="main machine's address"):
        launch_topology({**CFG, "num_machines": 2}, env={"DFLASH_MACHINE_RANK": "1"}).launch_args()
    with pytest.raises(ValueError, match="outside 0..1"):
        launch_topology(
            {**CFG, "num_machines": 2, "main_process_ip": "h"}, env={"DFLASH_MACHINE_RANK": "2"}
        ).launch_args()


def test_profile_machines_with_env_rank_and_overrides():
    cfg = {**CFG, "num_processes": 1, "num_machines": 2, "main_process_ip": "127.0.0.1"}
    topo = launch_topology(cfg, env={"DFLASH_MACHINE_RANK": "1", "DFLASH_MAIN_PROCESS_PORT": "29555"})
    assert (topo.num_machines, topo.machine_rank, topo.main_process_port, topo.source) == (2, 1, 29555, "env")
    a = topo.launch_args()
    assert a[a.index("--num_processes") + 1] == "2" and a[0] == "--multi_gpu"  # 2 machines × 1 process
    # DFLASH_MACHINE_RANK wins over SLURM_NODEID; the config address wins over the allocation's first host
    env = {
        "SLURM_JOB_ID": "1",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "a,b",
        "DFLASH_MACHINE_RANK": "1",
    }
    t2 = launch_topology({**CFG, "main_process_ip": "10.1.1.1"}, env=env)
    assert (t2.machine_rank, t2.main_process_ip) == (1, "10.1.1.1")


@pytest.mark.parametrize(
    "nodelist,host",
    [
        ("gpu[03-05,9],cpu1", "gpu03"),
        ("node7", "node7"),
        ("a,b", "a"),
        ("rack1-[10-12]-ib", "rack1-10-ib"),
        ("x[2]", "x2"),
    ],
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_first_slurm_host_rejects_empty():
    with pytest.raises(ValueError, match="nodelist"):
        first_slurm_host("")
