"""The running cluster of a job, as the training loop drives it: the protocol the loop calls (`protocol.Cluster`)
and the job's implementation of it (`running.RunningCluster`, started by `running.start_cluster`), built from
start-up and placement (`roles.start_roles`), the running worker groups (`roles.Roles`), the hand-over of the
devices between the Megatron groups and the rollout engines (`handover`), the weight sync (`sync_step`) and the
staged batch (`staged_batch`).

Light on purpose: `megarl train` imports `megarl.cluster.ray_node` to begin starting Ray before torch loads.
"""
