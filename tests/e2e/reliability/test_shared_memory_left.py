"""A finished run leaves /dev/shm as it found it, also with a TP 2 engine (issue 36), whose vLLM worker
processes hold most of the run's shared memory: the executor's and the TP group's message queues
(`psm_*`), the workers' multiprocessing semaphores (`sem.mp-*`), the CPU communicator's segments
(`vllm_dist_*cpushm_*`); with actor TP 2 the weights reach the workers through per-rank rings
(`megarl-bucket-*`). Each job has a /dev/shm of its own (`shm_testing.PrivateShm`): what is there
after it ended is what it left, whatever other processes on the machine do meanwhile. Stopped runs:
test_stop_signals.py."""

from reliability_job import Job


def test_a_finished_run_with_a_tp2_engine_leaves_no_shared_memory(workspace, tmp_path, jobs):
    job = Job.start(workspace, tmp_path / "run", ["rollout.tensor_model_parallel_size=2", "placement.mode=colocated"])
    jobs.append(job)
    # The check means something only once the engine's workers hold their segments.
    job.wait_for(lambda: any(name.startswith("psm_") for name in job.shm.leftovers()), "vLLM's queues in /dev/shm")
    job.wait_for(lambda: job.last_step() >= 1, "step 1 logged")
    job.rank_processes()  # note the job's processes, to check they are gone at the end

    assert job.wait() == 0, job.output()[-4000:]
    assert job.shm.leftovers() == []
    assert job.leftovers() == []
